"""`ViewLoader`: batches of L large + S small augmented views from a shard set, through a backend
(`pretrain.views.backend.ViewBackend`): "dali" (`pretrain.views.dali`, CPU or GPU) or "reference" (the
same augmentations with PIL/torchvision on a torch DataLoader; the fallback when DALI is missing).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from relicv2.jobs.device import resolve_device
from relicv2.pretrain.views.ahead import Made, Position, ahead, stop
from relicv2.pretrain.views.backend import BackendBatch, BackendSetup, ViewBackend
from relicv2.pretrain.views.config import ViewConfig, loader_threads, ready_batches
from relicv2.pretrain.views.source import (
    GLOBAL_POSITION,
    StateVersionError,
    batch_from_global_position,
)
from relicv2.shards.sample_set import SampleSet, exclude_samples, load_sample_set
from relicv2.shards.shardset import Spec

# 3: the reference backend's order and views no longer depend on the number of ranks
STATE_VERSION = 3
VERIFY_MODES = ("structure", "decode")


def dali_available() -> bool:
    """True when NVIDIA DALI can be imported."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class ViewLoader:
    """Iterable over batches `{"views": [L+S tensors NCHW], "keys": [str], "labels": tensor|None,
    "masking": (large views masked, large views)}`.

    `backend` overrides `views.backend`. With `views.debug_params` each batch also has `params`
    (float B x (L+S) x len(PARAM_NAMES), columns named by `pretrain.views.config.PARAM_NAMES`). `verify`
    is "structure" (cheap checks of every sample at start) or "decode" (decode every image with
    DALI's decoder first); bad samples are left out and counted in `skipped`.
    """

    def __init__(self, shards: Spec, batch_size: int, views: ViewConfig | None = None, *, device: str = "cpu",
                 rank: int = 0, world_size: int = 1, seed: int = 0, backend: str | None = None,
                 verify: str = "structure") -> None:
        views = ViewConfig() if views is None else views
        if not isinstance(views, ViewConfig):
            raise TypeError(f"views must be a ViewConfig, got {type(views).__name__}")
        device = resolve_device(device)  # ConfigError (a ValueError) for a device this machine lacks
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if backend is not None:
            views = dataclasses.replace(views, backend=backend)  # ViewConfig refuses an unknown one
        if views.backend == "dali" and not dali_available():
            warnings.warn("NVIDIA DALI is not installed; using the PIL/torchvision reference backend", stacklevel=2)
            views = dataclasses.replace(views, backend="reference")
        self.config: ViewConfig = dataclasses.replace(views, num_threads=loader_threads(views, device),
                                                      ready_batches=ready_batches(views, device))
        self.batch_size, self.device, self.rank, self.world_size, self.seed = batch_size, device, rank, world_size, seed
        decode_check = None
        if verify == "decode":
            from relicv2.pretrain.views.dali import find_undecodable

            decode_check = find_undecodable
        self.samples: SampleSet = load_sample_set(shards, decode_check=decode_check)
        self.has_masks = self.samples.has_masks  # a `mask.png` member in any usable sample
        if self.epoch_size < batch_size:
            raise ValueError(f"{shards} gives each of {world_size} ranks {self.epoch_size} samples, "
                             f"fewer than one batch of {batch_size}; use a smaller batch or more data")
        self.excluded: dict[str, str] = {}  # samples left out during the run, {key: reason}
        self.unreadable = 0  # samples dropped from their batch because they could not be read
        self.epoch = 0
        self.batch_in_epoch = 0
        self._restore: dict | None = None
        self._backend: ViewBackend | None = None
        self._made: Iterator[Made] | None = None
        self._position: Position | None = None  # after the last batch delivered (set when the backend is built)

    @property
    def epoch_size(self) -> int:
        """Samples this rank delivers per epoch: the smallest rank's share (every rank the same number)."""
        return len(self.samples) // self.world_size

    @property
    def skipped(self) -> dict[str, int]:
        """Samples left out (or read without a mask), by reason."""
        return dict(self.samples.skipped + Counter(unreadable=self.unreadable))

    def __len__(self) -> int:
        """Full batches per epoch on this rank."""
        return batches_per_epoch(self.samples, self.world_size, self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The remaining batches of the current epoch (a whole epoch after the previous one ended).

        With `views.ready_batches` > 0 they are made in a background thread that runs on across
        epochs; breaking off an iteration loses nothing (the next one continues after the last
        batch delivered).
        """
        if self._made is None:  # the stream of made batches from the loader's position, started on first use
            backend = self._ensure_backend()
            # The stream gets the backend and the sample set, never the loader: a thread that made
            # batches ahead must not keep its loader alive (dropping the loader stops the thread).
            items = _made_batches(backend, self.samples, self._position, self.batch_size, self.world_size,
                                  self.device, self.config)
            self._made = ahead(items, self.config.ready_batches, self.device)
        made = self._made
        while True:
            item = next(made)
            self._position = item.position  # the loader's state now describes the position after `item`
            self.epoch, self.batch_in_epoch = item.position.epoch, item.position.batch_in_epoch
            self.excluded = dict(item.position.excluded)
            self.unreadable += item.unreadable
            if item.batch is None:  # the epoch ended; the position is the next epoch's start
                return
            yield item.batch

    def state_dict(self) -> dict[str, Any]:
        """Resume position after the last batch delivered: epoch, batch within it, the backend's
        reader/random state (batches made ahead but not delivered are made again on resume)."""
        self._ensure_backend()
        return {"version": STATE_VERSION, "backend": self.config.backend, "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch, "samples": len(self.samples),
                "world_size": self.world_size, "rank": self.rank, "seed": self.seed,
                "excluded": dict(self.excluded), "backend_state": self._position.backend_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batch that was last delivered when `state` was taken: this loader's own
        `state_dict()` (same ranks: exact, reader state included) or a global position
        (`pretrain.views.source.global_position_state`), which the "reference" backend continues exactly
        and the "dali" one from a new reader order (DALI's reader state belongs to one split of the ranks).
        """
        if state.get("format") == GLOBAL_POSITION:
            position = batch_from_global_position(state, self.batch_size, self.world_size, len(self))
            self.epoch, self.batch_in_epoch = position
            self._drop_backend()
            return
        if state.get("version") != STATE_VERSION:
            raise StateVersionError(  # pretrain.resume falls back to the global position
                f"the loader state has version {state.get('version')!r}, from another relicv2 version (this one "
                f"writes {STATE_VERSION})")
        if state.get("excluded"):
            exclude_samples(self.samples, state["excluded"])
            self.excluded.update(state["excluded"])
        expected = {"backend": self.config.backend, "samples": len(self.samples), "world_size": self.world_size,
                    "rank": self.rank, "seed": self.seed}
        for name, value in expected.items():
            if state.get(name) != value:
                raise ValueError(f"loader state was saved with {name}={state.get(name)!r} but this loader "
                                 f"has {value!r}; resume with the same shards, seed, backend and ranks")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._drop_backend(restore=state["backend_state"])

    def _ensure_backend(self) -> ViewBackend:
        """The backend, built at the loader's position (the position's snapshot taken with it)."""
        if self._backend is None:
            setup = BackendSetup(
                samples=self.samples, config=self.config, batch_size=self.batch_size, batches_per_epoch=len(self),
                device=self.device, rank=self.rank, world_size=self.world_size, seed=self.seed, epoch=self.epoch,
                batch_in_epoch=self.batch_in_epoch, restore=self._restore,
            )
            if self.config.backend == "dali":  # imported here: the DALI backend loads DALI
                from relicv2.pretrain.views.dali import DaliBackend as Backend
            else:
                from relicv2.pretrain.views.reference import ReferenceBackend as Backend
            self._backend = Backend(setup)
            self._restore = None
            self._position = Position(self.epoch, self.batch_in_epoch, self._backend.state(), dict(self.excluded))
        return self._backend

    def _drop_backend(self, restore: dict | None = None) -> None:
        stop(self._made)
        self._made = None
        self._backend = None
        self._restore = restore  # what the next backend restores at the loader's position


def _finish(batch: BackendBatch, device: str, config: ViewConfig) -> dict[str, Any]:
    """A backend's batch with its views on the training device and dtype, and `params` when asked for."""
    dtype = torch.bfloat16 if config.output_dtype == "bfloat16" else torch.float32
    views = [v.to(device, dtype=dtype, non_blocking=True) for v in batch.views]
    out: dict[str, Any] = {"views": views, "keys": batch.keys, "labels": batch.labels,
                           "masking": (batch.masked_views, len(batch.keys) * config.large_views)}
    if config.debug_params:
        out["params"] = batch.params
    return out


def batches_per_epoch(samples: SampleSet, world_size: int, batch_size: int) -> int:
    """Full batches per epoch on each rank: its share of the samples, the smallest rank's (so that every rank
    runs the same number of batches and none delivers one of the reader's padding duplicates)."""
    return len(samples) // world_size // batch_size


def _made_batches(backend: ViewBackend, samples: SampleSet, start: Position, batch_size: int, world_size: int,
                  device: str, config: ViewConfig) -> Iterator[Made]:
    """Every batch from `start` on, epoch after epoch (`_finish`ed), each with the loader position after it.

    Samples the backend leaves out shrink the epoch from then on (`len(ViewLoader)` follows them).
    """
    epoch, batch_in_epoch, excluded = start.epoch, start.batch_in_epoch, dict(start.excluded)
    while True:
        while batch_in_epoch < batches_per_epoch(samples, world_size, batch_size):
            batch = backend.next_batch()
            if batch.excluded:
                exclude_samples(samples, batch.excluded)
                excluded.update(batch.excluded)
            batch_in_epoch += 1
            position = Position(epoch, batch_in_epoch, backend.state(), dict(excluded))
            yield Made(_finish(batch, device, config), position, unreadable=batch.unreadable)
        backend.end_epoch()
        epoch, batch_in_epoch = epoch + 1, 0
        yield Made(None, Position(epoch, batch_in_epoch, backend.state(), dict(excluded)))

"""`ViewLoader`: batches of L large + S small augmented views from a shard set.

Backends: "dali" (the DALI pipeline of `dali_views`, CPU or GPU) and "reference" (the same
augmentations with PIL/torchvision on a torch DataLoader; the fallback when DALI is missing).
An epoch on a rank is `len(loader)` full batches; the incomplete last batch is dropped, and all
ranks run the same number of batches (the reader pads the smaller ranks' shares).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pretrain.views.config import PARAM_NAMES, ViewConfig, view_config_from_options
from pretrain.views.sources import SampleSet, exclude_samples, load_sample_set, samples_per_rank

STATE_VERSION = 1


def dali_available() -> bool:
    """True when NVIDIA DALI can be imported."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class ViewLoader:
    """Iterable over batches `{"views": [L+S tensors NCHW], "keys": [str], "labels": tensor|None}`.

    With `debug_params=True` each batch also has `params` (float tensor B x (L+S) x len(PARAM_NAMES),
    columns named by `view_config.PARAM_NAMES`, "masked" and "coverage" included).
    `verify` is "structure" (cheap checks of every sample at start) or "decode" (decode every image
    with DALI's decoder first); bad samples are left out and counted in `skipped`.
    """

    def __init__(
        self,
        shards: Path | str,
        batch_size: int,
        *,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        verify: str = "structure",
        **view_options,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        if verify not in ("structure", "decode"):
            raise ValueError(f"verify must be 'structure' or 'decode', got {verify!r}")
        self.config: ViewConfig = view_config_from_options(**view_options)
        if self.config.backend == "dali" and not dali_available():
            warnings.warn("NVIDIA DALI is not installed; using the PIL/torchvision reference backend", stacklevel=2)
            self.config = view_config_from_options(**{**view_options, "backend": "reference"})
        self.batch_size, self.device, self.rank, self.world_size, self.seed = batch_size, device, rank, world_size, seed
        decode_check = None
        if verify == "decode":
            from pretrain.views.dali import find_undecodable

            decode_check = find_undecodable
        self.samples: SampleSet = load_sample_set(shards, decode_check=decode_check)
        self.epoch_size = samples_per_rank(len(self.samples), world_size)  # samples per rank per epoch
        if self.epoch_size < batch_size:
            raise ValueError(
                f"{shards} gives each of {world_size} ranks {self.epoch_size} samples, fewer than one "
                f"batch of {batch_size}; use a smaller batch or more data"
            )
        self.excluded: dict[str, str] = {}  # samples left out during the run, {key: reason}
        self.epoch = 0
        self.batch_in_epoch = 0
        self._restore: dict | None = None
        self._backend = None

    @property
    def skipped(self) -> dict[str, int]:
        """Samples left out (or read without a mask), by reason."""
        return dict(self.samples.skipped)

    def __len__(self) -> int:
        """Full batches per epoch on this rank."""
        return self.epoch_size // self.batch_size

    def __iter__(self) -> Iterator[dict]:
        """The remaining batches of the current epoch (a whole epoch after the previous one ended)."""
        backend = self._ensure_backend()
        while self.batch_in_epoch < len(self):
            batch = backend.next_batch()
            self.batch_in_epoch += 1
            yield self._finish(batch)
        backend.end_epoch()
        self.epoch += 1
        self.batch_in_epoch = 0

    def state_dict(self) -> dict:
        """Resume position: epoch, batch within it, and the backend's reader/random state."""
        backend = self._ensure_backend()
        return {
            "version": STATE_VERSION,
            "backend": self.config.backend,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples": len(self.samples),
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "excluded": dict(self.excluded),
            "backend_state": backend.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch that was last delivered when `state` was taken."""
        if state.get("excluded"):
            self.exclude(state["excluded"])
        expected = {"backend": self.config.backend, "samples": len(self.samples), "world_size": self.world_size,
                    "rank": self.rank, "seed": self.seed}
        for name, value in expected.items():
            if state.get(name) != value:
                raise ValueError(
                    f"loader state was saved with {name}={state.get(name)!r} but this loader has {value!r}; "
                    "resume with the same shards, seed, backend and ranks"
                )
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._backend = None
        self._restore = state["backend_state"]

    def exclude(self, bad: dict[str, str]) -> None:
        """Leave samples out from now on ({key: reason}); the per-rank epoch shrinks accordingly."""
        exclude_samples(self.samples, bad)
        self.excluded.update(bad)
        self.epoch_size = samples_per_rank(len(self.samples), self.world_size)

    def _ensure_backend(self):
        if self._backend is None:
            if self.config.backend == "dali":
                from pretrain.views.dali import DaliBackend

                self._backend = DaliBackend(self, self._restore)
            else:
                from pretrain.views.reference import ReferenceBackend

                self._backend = ReferenceBackend(self, self._restore)
            self._restore = None
        return self._backend

    def _finish(self, batch: dict) -> dict:
        """Move views to the requested device and dtype; drop `params` unless asked for."""
        dtype = torch.bfloat16 if self.config.output_dtype == "bfloat16" else torch.float32
        views = [v.to(self.device, dtype=dtype, non_blocking=True) for v in batch["views"]]
        out = {"views": views, "keys": batch["keys"], "labels": batch["labels"]}
        if self.config.debug_params:
            out["params"] = batch["params"]
        return out


def assemble_params(per_view: list[np.ndarray], masked: list[np.ndarray], coverage: np.ndarray, grey: np.ndarray) -> torch.Tensor:
    """B x V x len(PARAM_NAMES) tensor from per-view drawn values (backend-neutral layout)."""
    b, v = len(coverage), len(per_view)
    out = np.zeros((b, v, len(PARAM_NAMES)), np.float32)
    col = {n: i for i, n in enumerate(PARAM_NAMES)}
    rest = [n for n in PARAM_NAMES if n not in ("masked", "coverage", "grey")]
    for j in range(v):
        out[:, j, [col[n] for n in rest]] = per_view[j]
        out[:, j, col["masked"]] = masked[j]
        out[:, j, col["coverage"]] = coverage
        out[:, j, col["grey"]] = grey
    return torch.from_numpy(out)


def labels_tensor(labels: list[int | None]) -> torch.Tensor | None:
    """int64 labels, -1 for unlabelled samples; None when no sample of the batch has a label."""
    if all(label is None for label in labels):
        return None
    return torch.tensor([-1 if label is None else label for label in labels], dtype=torch.int64)


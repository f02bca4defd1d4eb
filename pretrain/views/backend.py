"""The seam between `ViewLoader` and its backends (DALI pipeline, PIL/torchvision reference).

A backend gets everything it needs at construction (`BackendSetup`) and never sees the loader:
it produces batches, runs to the end of an epoch, and reports its resumable state. Samples it has
to leave out are returned in `BackendBatch.excluded`, and the loader does its own bookkeeping.
The helpers that build a batch's fields live here too, so backends and loader import this module
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from relicv2.pretrain.views.config import DRAWN_PARAM_NAMES, PARAM_NAMES, ViewConfig
from relicv2.shards.sample_set import SampleSet


@dataclass(frozen=True)
class BackendSetup:
    """What a backend is built from: the samples, the view options and this rank's place.

    `epoch` and `batch_in_epoch` are where the loader stands (a backend rebuilt mid-epoch starts
    there); `restore` is the state a previous backend returned from `state()`, or None.
    """

    samples: SampleSet
    config: ViewConfig
    batch_size: int
    batches_per_epoch: int
    device: str
    rank: int
    world_size: int
    seed: int
    epoch: int = 0
    batch_in_epoch: int = 0
    restore: dict[str, Any] | None = None


@dataclass
class BackendBatch:
    """One batch from a backend, before the loader moves it to the training device.

    `excluded`: samples the backend found undecodable while producing it ({key: reason}); the
    loader records them (they stay out on resume) and shrinks its epoch. `unreadable`: samples
    dropped from this batch because they could not be read (the batch is smaller by as many).
    `masked_views`: how many of its large views had their background removed (the masking applied).
    """

    views: list[torch.Tensor]
    keys: list[str]
    labels: torch.Tensor | None
    params: torch.Tensor | None = None
    excluded: dict[str, str] = field(default_factory=dict)
    unreadable: int = 0
    masked_views: int = 0


def assemble_params(per_view: list[np.ndarray], masked: list[np.ndarray], coverage: np.ndarray,
                    grey: np.ndarray) -> torch.Tensor:
    """B x V x len(PARAM_NAMES) tensor (backend-neutral layout) from per-view B x DRAWN_PARAM_NAMES draws."""
    out = np.zeros((len(coverage), len(per_view), len(PARAM_NAMES)), np.float32)
    col = {n: i for i, n in enumerate(PARAM_NAMES)}
    rest = [col[n] for n in DRAWN_PARAM_NAMES]
    for j, drawn in enumerate(per_view):
        out[:, j, rest] = drawn
        out[:, j, col["masked"]] = masked[j]
        out[:, j, col["coverage"]] = coverage
        out[:, j, col["grey"]] = grey
    return torch.from_numpy(out)


def labels_tensor(labels: list[int | None]) -> torch.Tensor | None:
    """int64 labels, -1 for unlabelled samples; None when no sample of the batch has a label."""
    if all(label is None for label in labels):
        return None
    return torch.tensor([-1 if label is None else label for label in labels], dtype=torch.int64)


@runtime_checkable
class ViewBackend(Protocol):
    """Produces the batches of one rank, epoch after epoch."""

    def next_batch(self) -> BackendBatch:
        """The next full batch of the current epoch."""

    def end_epoch(self) -> None:
        """Called after the epoch's last delivered batch: skip what is left so the next batch
        is the first of the next epoch."""

    def state(self) -> dict[str, Any]:
        """What a new backend needs (as `BackendSetup.restore`) to continue after the last batch."""

"""The seam between `ViewLoader` and its backends (DALI pipeline, PIL/torchvision reference).

A backend gets everything it needs at construction (`BackendSetup`) and never sees the loader:
it produces batches, runs to the end of an epoch, and reports its resumable state. Samples it has
to leave out are returned in `BackendBatch.excluded`, and the loader does its own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pretrain.views.batch import BackendBatch
from pretrain.views.config import ViewConfig
from pretrain.views.sources import SampleSet


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


@runtime_checkable
class ViewBackend(Protocol):
    """Produces the batches of one rank, epoch after epoch."""

    def next_batch(self) -> BackendBatch:
        """The next full batch of the current epoch."""
        ...

    def end_epoch(self) -> None:
        """Called after the epoch's last delivered batch: skip what is left so the next batch
        is the first of the next epoch."""
        ...

    def state(self) -> dict[str, Any]:
        """What a new backend needs (as `BackendSetup.restore`) to continue after the last batch."""
        ...

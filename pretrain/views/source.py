"""What the trainer takes as its data: a :class:`ViewSource` (``pretrain.views.loader.ViewLoader`` over
shards, or ``pretrain.views.synthetic.SyntheticViews``), and the data position every source can load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ViewSource(Protocol):
    """One rank's stream of multi-view batches.

    - ``epoch_size``: samples this rank sees per epoch (its share of the data set);
    - ``len(source)``: full batches per rank per epoch, ``epoch_size // batch_size`` (the
      incomplete last batch is dropped, by every source);
    - iterating yields one epoch of batches: ``{"views": list[Tensor], "keys": list[str],
      "labels": Tensor | None, ...}``; the next iteration is the next epoch;
    - ``state_dict()`` / ``load_state_dict()``: the position in the data, so a resumed run
      gets exactly the next batch.
    """

    batch_size: int

    @property
    def epoch_size(self) -> int: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


GLOBAL_POSITION = "global-position"  # the `format` of a data position that any world size can load


class StateVersionError(ValueError):
    """A data-source state written by another version of the loader (its stream may differ)."""


def global_position_state(epoch: int, samples: int, global_batch: int) -> dict[str, Any]:
    """A data position every source accepts in `load_state_dict`, whatever its number of ranks:
    `samples` consumed in `epoch`'s global order with global batches of `global_batch`."""
    return {"format": GLOBAL_POSITION, "epoch": int(epoch), "samples": int(samples), "global_batch": int(global_batch)}


def batch_from_global_position(state: dict[str, Any], batch_size: int, world_size: int,
                               batches_per_epoch: int) -> tuple[int, int]:
    """(epoch, batch in epoch) for a rank with `batch_size` of `world_size` ranks; ValueError when
    the position does not fit (another global batch, or past the end of the epoch)."""
    epoch, samples, global_batch = int(state["epoch"]), int(state["samples"]), int(state["global_batch"])
    if global_batch != batch_size * world_size:
        raise ValueError(f"the position counts global batches of {global_batch}, this source delivers "
                         f"{batch_size} x {world_size} ranks = {batch_size * world_size}")
    batch, rest = divmod(samples, global_batch)
    if epoch < 0 or rest or not 0 <= batch <= batches_per_epoch:
        raise ValueError(f"position {samples} samples into epoch {epoch} is not a batch boundary of an epoch "
                         f"of {batches_per_epoch} batches of {global_batch}")
    return epoch, batch

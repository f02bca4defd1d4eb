"""What the trainer takes as its data: a :class:`ViewSource` (shards through ``ViewLoader``, or generated views).

Both ``pretrain.views.loader.ViewLoader`` and ``pretrain.views.synthetic.SyntheticViews``
satisfy it; the trainer depends on this Protocol only.
"""

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

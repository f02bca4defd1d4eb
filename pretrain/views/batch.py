"""The batch both view backends deliver, and the helpers that build its fields (a leaf module).

Kept apart from `loader.py` so the backends (`dali.py`, `reference.py`) and the loader all import
it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pretrain.views.config import DRAWN_PARAM_NAMES, PARAM_NAMES


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


def assemble_params(
    per_view: list[np.ndarray], masked: list[np.ndarray], coverage: np.ndarray, grey: np.ndarray
) -> torch.Tensor:
    """B x V x len(PARAM_NAMES) tensor from per-view drawn values (backend-neutral layout).

    `per_view[j]` is B x DRAWN_PARAM_NAMES.
    """
    b, v = len(coverage), len(per_view)
    out = np.zeros((b, v, len(PARAM_NAMES)), np.float32)
    col = {n: i for i, n in enumerate(PARAM_NAMES)}
    rest = [col[n] for n in DRAWN_PARAM_NAMES]
    for j in range(v):
        out[:, j, rest] = per_view[j]
        out[:, j, col["masked"]] = masked[j]
        out[:, j, col["coverage"]] = coverage
        out[:, j, col["grey"]] = grey
    return torch.from_numpy(out)


def labels_tensor(labels: list[int | None]) -> torch.Tensor | None:
    """int64 labels, -1 for unlabelled samples; None when no sample of the batch has a label."""
    if all(label is None for label in labels):
        return None
    return torch.tensor([-1 if label is None else label for label in labels], dtype=torch.int64)

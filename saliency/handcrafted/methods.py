"""The registry of handcrafted saliency methods: name -> ``rgb uint8 HxWx3 -> float32 HxW``.

An explicit dict (no registration by import side effect); every function is pure and
deterministic, so it can be shipped to worker processes by name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from saliency.handcrafted.dsr import dsr_saliency
from saliency.handcrafted.mc import mc_saliency
from saliency.handcrafted.mr import mr_saliency
from saliency.handcrafted.rbd import rbd_saliency

SaliencyMethod = Callable[[np.ndarray], np.ndarray]

METHODS: dict[str, SaliencyMethod] = {
    "rbd": rbd_saliency,
    "mr": mr_saliency,
    "dsr": dsr_saliency,
    "mc": mc_saliency,
}


def resolve_methods(name: str) -> list[str]:
    """``"all"`` or a comma-separated list of method names -> validated list of names."""
    names = list(METHODS) if name == "all" else [n.strip() for n in name.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(
            f"unknown saliency method(s) {unknown or name!r}; choose from {', '.join(METHODS)} or 'all'"
        )
    return names

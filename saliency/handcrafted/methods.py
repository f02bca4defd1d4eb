"""The registry of handcrafted saliency methods, name -> ``rgb uint8 HxWx3 -> float32 HxW``: an explicit
dict (no registration by import side effect) of pure, deterministic functions, shipped to workers by name.
Its keys are the package's ``METHOD_NAMES``, in that order (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from relicv2.saliency.handcrafted.dsr import DSRConfig, dsr_saliency
from relicv2.saliency.handcrafted.mc import MCConfig, mc_saliency
from relicv2.saliency.handcrafted.mr import MRConfig, mr_saliency
from relicv2.saliency.handcrafted.rbd import RBDConfig, rbd_saliency

SaliencyMethod = Callable[[np.ndarray], np.ndarray]

METHODS: dict[str, SaliencyMethod] = {
    "rbd": rbd_saliency, "mr": mr_saliency, "dsr": dsr_saliency, "mc": mc_saliency
}

CONFIGS: dict[str, type] = {"rbd": RBDConfig, "mr": MRConfig, "dsr": DSRConfig, "mc": MCConfig}
"""Each method's frozen parameter dataclass (defaults: the authors' code); ``METHODS[name](rgb, config)``."""

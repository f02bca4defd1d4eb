"""The linear probe's settings: one frozen dataclass, its two protocols (presets `paper` and `fast` in
`evaluation/presets/linear/`). A leaf: the probe (`linear`) and the paper protocol's loop (`paper`)
both read it, and neither imports the other for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relicv2.pretrain.schedules import learning_rate, peak_learning_rate
from relicv2.pretrain.views.config import FULL_CROP_SCALE, IMAGE_SIZE, resize_of

PROTOCOLS = ("paper", "fast")


@dataclass(frozen=True)
class LinearConfig:
    """Options of the linear probe (presets `paper` and `fast` in `evaluation/presets/linear/`)."""

    protocol: str = "paper"
    epochs: int = 100
    batch_size: int = 1024  # global, over all ranks
    base_lr: float = 0.3  # peak lr = base_lr * batch_size / 256
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0
    crop_size: int = IMAGE_SIZE
    resize_size: int = resize_of(IMAGE_SIZE)  # test views: short side before the centre crop; 0: crop_size / 0.875
    crop_scale: tuple[float, float] = FULL_CROP_SCALE  # train views (paper protocol)
    seed: int = 0
    workers: int = 2  # decoding workers / DALI threads (paper protocol)
    backend: str = "dali"  # paper protocol views: "dali" (CPU or GPU decoding) or "pil" (torch DataLoader)
    feature_batch: int = 256  # images per forward pass of the frozen encoder

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"linear protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        for name in ("epochs", "batch_size", "crop_size", "feature_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear.{name} must be positive, got {getattr(self, name)}")
        if self.base_lr <= 0 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError("linear.base_lr must be > 0, momentum in [0, 1) and weight_decay >= 0")
        if self.backend not in ("dali", "pil"):
            raise ValueError(f"linear.backend must be 'dali' or 'pil', got {self.backend!r}")
        if not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError(f"linear.crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}")

    @property
    def name(self) -> str:
        return f"linear-{self.protocol}"

    @property
    def peak_lr(self) -> float:
        return peak_learning_rate(self.base_lr, self.batch_size)

    def learning_rates(self, total_steps: int) -> Callable[[int], list[float]]:
        """The head's lr at a global step: cosine from `peak_lr` over `total_steps`, no warm-up."""
        return lambda step: [learning_rate(step, peak_lr=self.peak_lr, warmup_steps=0, total_steps=total_steps)]

"""Learning-rate and EMA schedules as pure functions of the global step (BYOL/ReLICv2 recipe)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def peak_learning_rate(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """The lr at the end of warmup: base_lr scaled linearly with the global batch (base_lr * batch / reference_batch)."""
    return base_lr * global_batch / reference_batch


def learning_rate(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int) -> float:
    """lr at `step`: linear warmup from 0 to `peak_lr` (see `peak_learning_rate`), then cosine to 0;
    lr(0) = 0, lr(warmup_steps) = peak, lr(total_steps) = 0, steps past the end stay at 0."""
    if total_steps <= 0 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps > 0, got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not math.isfinite(peak_lr):
        raise ValueError(f"peak lr must be finite, got {peak_lr}")
    step = min(max(step, 0), total_steps)
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    if step == total_steps:  # also where the warmup takes the whole schedule
        return 0.0
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def step_decay(step: int, *, peak_lr: float, milestones: Sequence[int], decay: float) -> float:
    """lr at `step`: `peak_lr` times `decay` once for every milestone step reached (multi-step decay)."""
    return peak_lr * decay ** sum(step >= milestone for milestone in milestones)


def ema_coefficient(step: int, *, base: float, total_steps: int) -> float:
    """Target EMA coefficient gamma_k = 1 - (1 - base) (cos(pi k / K) + 1) / 2: base at 0, 1 at K."""
    step = min(max(step, 0), total_steps)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * step / total_steps) + 1.0) / 2.0

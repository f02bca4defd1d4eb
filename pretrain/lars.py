"""LARS (You et al. 2017) as used by BYOL/ReLICv2, and the parameter split it needs.

Hand-written because torch has no LARS; the update follows BYOL's reference optimizer
(deepmind-research `byol/utils/optimizers.py`), per parameter w with gradient g:

    u = g + weight_decay * w
    trust = trust_coefficient * ||w|| / ||u||   (1 when either norm is 0)
    m <- momentum * m + trust * u
    w <- w - lr * m

(the learning rate multiplies the momentum buffer, as in BYOL's optax chain, so a changed lr
applies at once). Parameter groups with "lars_exclude": True (biases, BatchNorm) skip both the
weight decay and the trust ratio: m <- momentum * m + g.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# Normalisation layers whose scale/shift must not be decayed or adapted (BYOL excludes BN).
_NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling with momentum; see the module docstring for the update."""

    def __init__(self, param_groups: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 1e-3) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(f"invalid LARS settings: lr={lr}, momentum={momentum}, "
                             f"weight_decay={weight_decay}, trust_coefficient={trust_coefficient}")
        super().__init__(param_groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                            trust_coefficient=trust_coefficient, lars_exclude=False))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]  (no closure: the trainer computes the loss itself)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["lars_exclude"]:
                updates = grads
            else:
                # u = g + weight_decay * w: new tensors, so scaling them in place leaves the gradients as they are
                updates = torch._foreach_add(grads, params, alpha=group["weight_decay"])
                param_norms = torch.stack(torch._foreach_norm(params))
                update_norms = torch.stack(torch._foreach_norm(updates))
                # Norms stay on the device: no host sync per parameter.
                trust = torch.where(
                    (param_norms > 0) & (update_norms > 0),
                    group["trust_coefficient"] * param_norms / update_norms,
                    torch.ones_like(param_norms),
                )
                torch._foreach_mul_(updates, list(trust.unbind()))
            for p in params:  # created at a parameter's first update
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            buffers = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, updates)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters of `model` in LARS groups: weights of convolutions / linear layers (ndim >= 2)
    with `weight_decay`; biases (ndim <= 1) and all normalisation parameters with "lars_exclude" and no
    weight decay. Empty groups are left out."""
    adapted, excluded, seen = [], [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, _NORM_LAYERS) or param.ndim <= 1:
                excluded.append(param)
            else:
                adapted.append(param)
    groups = [{"params": adapted, "weight_decay": weight_decay, "lars_exclude": False},
              {"params": excluded, "weight_decay": 0.0, "lars_exclude": True}]
    return [group for group in groups if group["params"]]

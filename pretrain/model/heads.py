"""Projector/predictor MLPs, the online and target networks, and the target's EMA update."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pretrain.model.resnet import resnet


class MLP(nn.Module):
    """Linear(in, hidden) - BatchNorm1d - ReLU - Linear(hidden, out): BYOL's projector/predictor."""

    def __init__(self, in_dim: int, hidden_dim: int = 4096, out_dim: int = 256) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.relu = nn.ReLU(inplace=True)
        self.linear2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.relu(self.bn(self.linear1(x))))


class OnlineNetwork(nn.Module):
    """Encoder f, projector and predictor (the paper's h): `forward(x)` is the prediction [B, out]."""

    def __init__(self, encoder: nn.Module, projector: MLP, predictor: MLP) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.predictor = predictor

    def forward(self, x: Tensor) -> Tensor:
        return self.predictor(self.projector(self.encoder(x)))


class TargetNetwork(nn.Module):
    """EMA copy of the online encoder and projector (the paper's g and q): `forward(x)` is the projection."""

    def __init__(self, encoder: nn.Module, projector: MLP) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector

    def forward(self, x: Tensor) -> Tensor:
        return self.projector(self.encoder(x))


def build_networks(
    depth: int,
    width: int,
    *,
    hidden_dim: int = 4096,
    out_dim: int = 256,
    zero_init_residual: bool = False,
) -> tuple[OnlineNetwork, TargetNetwork]:
    """Online network and a target network initialised as an exact, frozen copy of its encoder+projector."""
    encoder = resnet(depth, width, zero_init_residual=zero_init_residual)
    projector = MLP(encoder.num_features, hidden_dim, out_dim)
    predictor = MLP(out_dim, hidden_dim, out_dim)
    online = OnlineNetwork(encoder, projector, predictor)
    target = TargetNetwork(copy.deepcopy(encoder), copy.deepcopy(projector))
    target.requires_grad_(False)
    return online, target


@torch.no_grad()
def ema_update(target: TargetNetwork, online: nn.Module, coefficient: float) -> None:
    """target <- coefficient * target + (1 - coefficient) * online, for encoder and projector.

    Parameters are averaged. Buffers (BatchNorm running mean/var and batch counters) are copied
    from the online network instead: the target is run in training mode, where BN normalises
    with batch statistics, so its running statistics only matter when the target is used in
    eval mode, and the online ones are the best estimate of the activations there. `online` may
    be wrapped in DistributedDataParallel.
    """
    if not 0.0 <= coefficient <= 1.0:
        raise ValueError(f"EMA coefficient must be in [0, 1], got {coefficient}")
    online = getattr(online, "module", online)  # unwrap DistributedDataParallel
    target_params, online_params, target_buffers, online_buffers = [], [], [], []
    for name in ("encoder", "projector"):
        target_part, online_part = getattr(target, name), getattr(online, name)
        target_params += list(target_part.parameters())
        online_params += list(online_part.parameters())
        target_buffers += list(target_part.buffers())
        online_buffers += list(online_part.buffers())
    if len(target_params) != len(online_params) or len(target_buffers) != len(online_buffers):
        raise ValueError("target and online networks have different architectures; build both with build_networks")
    # lerp(t, o, w) = t + w (o - t) = (1 - w) t + w o with w = 1 - coefficient.
    torch._foreach_lerp_(target_params, online_params, 1.0 - coefficient)
    torch._foreach_copy_(target_buffers, online_buffers)

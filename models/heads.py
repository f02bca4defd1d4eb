"""Projector/predictor MLPs, the online and target networks, and the target's EMA update."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from relicv2.models.resnet import resnet


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
    """Encoder f, projector and predictor (the paper's h): `forward(x)` is the prediction [B, out].

    With `activation_checkpointing`, training forwards keep only each residual block's input and
    recompute the block's activations during backward: the encoder's activation memory drops to
    about one block's, for roughly one extra encoder forward of compute. The state dict is the same.
    """

    def __init__(self, encoder: nn.Module, projector: MLP, predictor: MLP, *,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.predictor = predictor
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: Tensor) -> Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            features = checkpointed_encoder_forward(self.encoder, x)
        else:
            features = self.encoder(x)
        return self.predictor(self.projector(features))


class _RecomputeKeepsBatchNormStatistics:
    """A residual block called through `torch.utils.checkpoint`: the first call is the real forward;
    later calls (the recomputation in backward) restore the BatchNorm running statistics afterwards,
    so they are updated once per step, exactly as without checkpointing."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.calls = 0

    def __call__(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            return self.block(x)
        saved = [buffer.clone() for buffer in self.block.buffers()]
        try:
            return self.block(x)
        finally:  # also when checkpoint stops the recomputation early (it raises to do so)
            with torch.no_grad():
                torch._foreach_copy_(list(self.block.buffers()), saved)


def checkpointed_encoder_forward(encoder: nn.Module, x: Tensor) -> Tensor:
    """`encoder(x)` for a `models.resnet.ResNet`, with each residual block checkpointed."""
    x = encoder.maxpool(encoder.relu(encoder.bn1(encoder.conv1(x))))
    for stage in (encoder.layer1, encoder.layer2, encoder.layer3, encoder.layer4):
        for block in stage:
            x = checkpoint(_RecomputeKeepsBatchNormStatistics(block), x, use_reentrant=False)
    return torch.flatten(encoder.avgpool(x), 1)


class TargetNetwork(nn.Module):
    """EMA copy of the online encoder and projector (the paper's g and q): `forward(x)` is the projection."""

    def __init__(self, encoder: nn.Module, projector: MLP) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector

    def forward(self, x: Tensor) -> Tensor:
        return self.projector(self.encoder(x))


def build_networks(depth: int, width: int, *, hidden_dim: int = 4096, out_dim: int = 256,
                   zero_init_residual: bool = False,
                   activation_checkpointing: bool = False) -> tuple[OnlineNetwork, TargetNetwork]:
    """Online network and a target network initialised as an exact, frozen copy of its encoder+projector."""
    encoder = resnet(depth, width, zero_init_residual=zero_init_residual)
    projector = MLP(encoder.num_features, hidden_dim, out_dim)
    predictor = MLP(out_dim, hidden_dim, out_dim)
    online = OnlineNetwork(encoder, projector, predictor, activation_checkpointing=activation_checkpointing)
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
    target_part = nn.ModuleList([target.encoder, target.projector])
    online_part = nn.ModuleList([online.encoder, online.projector])
    target_params, online_params = list(target_part.parameters()), list(online_part.parameters())
    target_buffers, online_buffers = list(target_part.buffers()), list(online_part.buffers())
    # lerp(t, o, w) = t + w (o - t) = (1 - w) t + w o with w = 1 - coefficient.
    torch._foreach_lerp_(target_params, online_params, 1.0 - coefficient)
    torch._foreach_copy_(target_buffers, online_buffers)

"""ResNet encoders (18 to 200 layers, width 1/2/4) whose width-1 weights are torchvision's.

The residual blocks are torchvision's own `BasicBlock` / `Bottleneck`. Only the skeleton is
written here, because torchvision's `ResNet` cannot express the SimCLR/BYOL width multiplier:
its `width_per_group` widens the inner 3x3 convolution of a bottleneck only, keeps the stem at
64 channels and the block outputs at 256..2048, so a "wide" torchvision ResNet-50 still has 2048
features. SimCLR/BYOL widen every layer, stem included (2x ResNet-50 -> 4096 features). Passing
`planes = base_planes * width` to torchvision's blocks with the default `base_width=64` gives
exactly that, and at width 1 the module tree (and therefore every state-dict name) is
torchvision's, minus the classifier `fc`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relicv2.models.architecture import PADDINGS, STAGE_BLOCKS, STAGE_PLANES, WIDTHS


def block_class(kind: str) -> type[nn.Module]:
    """torchvision's residual block of a `kind` of STAGE_BLOCKS ("basic" or "bottleneck")."""
    # Imported when a network is built, not with this module: torchvision imports its detection ops and
    # torch._dynamo with them (more CPU than torch itself), which a process that only reads a file, a
    # config or the architecture table does not need.
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return Bottleneck if kind == "bottleneck" else BasicBlock


def _same_tf_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of one spatial axis under TensorFlow's "SAME" rule."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_same_tf(x: Tensor, kernel: int, stride: int, value: float = 0.0) -> Tensor:
    """`x` padded on both spatial axes under TensorFlow's "SAME" rule (square kernel and stride)."""
    top, bottom = _same_tf_pads(x.shape[-2], kernel, stride)
    left, right = _same_tf_pads(x.shape[-1], kernel, stride)
    return F.pad(x, (left, right, top, bottom), value=value)


class SameTFConv2d(nn.Conv2d):
    """A Conv2d (same parameters, same state-dict names) that pads like TensorFlow's "SAME"."""

    def forward(self, x: Tensor) -> Tensor:
        padded = _pad_same_tf(x, self.kernel_size[0], self.stride[0])
        return self._conv_forward(padded, self.weight, self.bias)


class SameTFMaxPool2d(nn.MaxPool2d):
    """Max pooling with TensorFlow's "SAME" padding (padded cells never win: they are -inf)."""

    def forward(self, x: Tensor) -> Tensor:
        padded = _pad_same_tf(x, self.kernel_size, self.stride, float("-inf"))
        return F.max_pool2d(padded, self.kernel_size, self.stride)


class ResNet(nn.Module):
    """ResNet trunk (stem, four residual stages, global average pooling; no classifier): images
    [B, 3, H, W] to pooled features [B, num_features]."""

    def __init__(self, block_kind: str, stage_blocks: tuple[int, int, int, int], width: int = 1, *,
                 zero_init_residual: bool = False, padding: str = "torch") -> None:
        super().__init__()
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {list(PADDINGS)}, got {padding!r}")
        self.padding = padding
        self.block_kind = block_kind
        block = block_class(block_kind)
        stem_channels = 64 * width
        self.conv1 = nn.Conv2d(3, stem_channels, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_channels = stem_channels
        stages = []
        for index, (planes, blocks) in enumerate(zip(STAGE_PLANES, stage_blocks, strict=True)):
            stride = 1 if index == 0 else 2
            stage, in_channels = _make_stage(block, in_channels, planes * width, blocks, stride)
            stages.append(stage)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.num_features: int = in_channels
        _initialise(self, block, zero_init_residual)
        if padding == "same_tf":
            _use_same_tf_padding(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)


def _make_stage(block: type[nn.Module], in_channels: int, planes: int, blocks: int,
                stride: int) -> tuple[nn.Sequential, int]:
    """One stage as torchvision builds it (projection shortcut `downsample` = conv1x1 + BN)."""
    out_channels = planes * block.expansion
    downsample = None
    if stride != 1 or in_channels != out_channels:
        downsample = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
            nn.BatchNorm2d(out_channels),
        )
    layers = [block(in_channels, planes, stride, downsample)]
    layers += [block(out_channels, planes) for _ in range(1, blocks)]
    return nn.Sequential(*layers), out_channels


def _use_same_tf_padding(model: nn.Module) -> None:
    """Swap every strided convolution and the max-pool for its "SAME"-padding twin, in place.

    Stride-1 layers keep torch's symmetric padding, which equals "SAME" for odd kernels. Names
    and parameters do not change, so state dicts move between both modes.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d) and module.stride != (1, 1):
            module.__class__ = SameTFConv2d
            module.padding = (0, 0)
        elif isinstance(module, nn.MaxPool2d):
            module.__class__ = SameTFMaxPool2d
            module.padding = 0


def _initialise(model: nn.Module, block: type[nn.Module], zero_init_residual: bool) -> None:
    """torchvision's initialisation: He-normal (fan-out) convolutions; BN keeps torch's scale 1, shift 0."""
    # With zero_init_residual each residual branch starts as zero, so every block starts as the identity
    # (Goyal et al. 2017, "Accurate, Large Minibatch SGD").
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif zero_init_residual and isinstance(module, block):
            # the residual branch's last BN: bn3 in a bottleneck, bn2 in a basic block
            nn.init.zeros_(getattr(module, "bn3", module.bn2).weight)


def resnet(depth: int, width: int = 1, *, zero_init_residual: bool = False, padding: str = "torch") -> ResNet:
    """ResNet-`depth` encoder with every layer `width` times wider (SimCLR/BYOL convention), giving
    `num_features` pooled features (512 * width for 18/34, 2048 * width for 50 and deeper); padding
    "same_tf" pads like TensorFlow/JAX "SAME" (for weights imported from the authors)."""
    if depth not in STAGE_BLOCKS:
        raise ValueError(f"ResNet depth {depth} is not supported; choose one of {sorted(STAGE_BLOCKS)}")
    if width not in WIDTHS:
        raise ValueError(f"ResNet width {width} is not supported; choose one of {list(WIDTHS)}")
    block_kind, stage_blocks = STAGE_BLOCKS[depth]
    return ResNet(block_kind, stage_blocks, width, zero_init_residual=zero_init_residual, padding=padding)


def to_torchvision_state_dict(model: ResNet) -> dict[str, Tensor]:
    """A width-1 encoder's weights under torchvision's names (no `fc.*`; load with strict=False)."""
    if model.conv1.out_channels != 64:
        stem = model.conv1.out_channels
        raise ValueError(f"only width-1 ResNets have torchvision weights (this one has a {stem}-channel "
                         "stem); export wider encoders with model.state_dict() instead")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def state_dict_differences(own: dict[str, Tensor], incoming: dict[str, Tensor]) -> str:
    """How `incoming` differs from a model's `own` state dict in names and shapes, e.g. "2 missing
    (e.g. layer4.1.conv1.weight); 1 wrong shape (e.g. fc.weight (10, 512) != (10, 2048))"; "" when it fits."""
    missing = sorted(set(own) - set(incoming))
    unexpected = sorted(set(incoming) - set(own))
    wrong_shape = sorted(f"{name} {tuple(incoming[name].shape)} != {tuple(own[name].shape)}"
                         for name in set(own) & set(incoming) if incoming[name].shape != own[name].shape)
    return "; ".join(f"{len(items)} {label} (e.g. {', '.join(items[:3])})"
                     for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
                     if items)


def load_torchvision_state_dict(model: ResNet, state_dict: dict[str, Tensor]) -> None:
    """Load a `torchvision.models.resnet*` state dict into `model` (its `fc.*` entries are dropped); a
    ValueError names the missing, unexpected or wrongly shaped entries of one for another depth or width."""
    incoming = {name: t for name, t in state_dict.items() if not name.startswith("fc.")}
    differences = state_dict_differences(model.state_dict(), incoming)
    if differences:
        raise ValueError(f"state dict does not fit this ResNet ({differences}); check that the weights are a "
                         "torchvision resnet of the same depth, at width 1, and without a 'module.' prefix")
    model.load_state_dict(incoming, strict=True)

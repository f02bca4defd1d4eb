"""Dilated ResNet stages (DeepLab's way, as torchvision's `replace_stride_with_dilation` builds them): the
stride-2 convolution of a stage's first block becomes stride 1, and every 3x3 convolution of the stage gets
dilation d except the first block's, which keeps the previous stage's dilation. Parameter shapes are
unchanged, so pretrained weights load as they are. Used by the saliency network (layer3 and layer4 dilated,
output stride 8) and the segmentation network of `relicv2 eval segment` (layer4, output stride 16)."""

from __future__ import annotations

from torch import nn

from relicv2.models.resnet import ResNet, SameTFConv2d


def dilate_stage(stage: nn.Sequential, block_kind: str, dilation: int, previous: int) -> None:
    """Turn `stage` (a ResNet stage of `block_kind` blocks whose first has stride 2) into a stride-1 stage of
    `dilation`, in place; `previous` is the dilation of the stage before it (1 when that one is not dilated)."""
    for index, block in enumerate(stage):
        first = index == 0
        if block_kind == "bottleneck":
            conv = block.conv2
        else:  # a basic block has two 3x3 convolutions; the stride sits on conv1
            block.conv2.dilation, block.conv2.padding = (dilation, dilation), (dilation, dilation)
            conv = block.conv1
        rate = previous if first else dilation
        conv.stride, conv.dilation, conv.padding = (1, 1), (rate, rate), (rate, rate)
        if first and block.downsample is not None:
            block.downsample[0].stride = (1, 1)
        for layer in (conv, block.downsample[0] if first and block.downsample is not None else None):
            if isinstance(layer, SameTFConv2d):  # at stride 1 "SAME" is torch's symmetric padding
                layer.__class__ = nn.Conv2d
        block.stride = 1


def dilate(encoder: ResNet, output_stride: int) -> ResNet:
    """`encoder` with its last stages dilated to `output_stride` (32: unchanged, 16: layer4, 8: layer3 and
    layer4), in place; returned for chaining."""
    if output_stride not in (8, 16, 32):
        raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
    if output_stride == 8:
        dilate_stage(encoder.layer3, encoder.block_kind, 2, 1)
        dilate_stage(encoder.layer4, encoder.block_kind, 4, 2)
    elif output_stride == 16:
        dilate_stage(encoder.layer4, encoder.block_kind, 2, 1)
    return encoder

"""The saliency network: a dilated ResNet encoder (output stride 8) and a light decoder to one logit map.

The encoder is `models.resnet` (so its weights are this project's, torchvision's or SwAV's
names); its last two stages are dilated by `models.dilated` (layer3 by 2, layer4 by 4), so pretrained
weights load as they are.

The decoder is a small DeepLabv3+-like head joining layer4's features with layer1's at stride 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relicv2.models.dilated import dilate
from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.models.resnet import resnet


def _conv_bn_relu(cin: int, cout: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SaliencyNet(nn.Module):
    """Images [B, 3, S, S] (ImageNet-normalised) -> foreground logits [B, 1, S, S]."""

    def __init__(self, depth: int = 50, width: int = 1):
        super().__init__()
        self.depth, self.width = depth, width
        self.encoder = resnet(depth, width)
        dilate(self.encoder, output_stride=8)  # layer3 and layer4 dilated
        low_channels = self.encoder.layer1[-1].conv1.in_channels  # layer1's output channels
        self.head = nn.Sequential(_conv_bn_relu(self.encoder.num_features, 128, 1), _conv_bn_relu(128, 128, 3))
        self.low = _conv_bn_relu(low_channels, 32, 1)
        self.fuse = nn.Sequential(_conv_bn_relu(160, 64, 3), nn.Conv2d(64, 1, 1))
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: Tensor) -> Tensor:
        size = images.shape[-2:]
        e = self.encoder
        x = e.maxpool(e.relu(e.bn1(e.conv1(images))))
        low = e.layer1(x)
        deep = self.head(e.layer4(e.layer3(e.layer2(low))))
        deep = F.interpolate(deep, size=low.shape[-2:], mode="bilinear", align_corners=False)
        logits = self.fuse(torch.cat([deep, self.low(low)], dim=1))
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)

    def normalise(self, images_uint8: Tensor) -> Tensor:
        """uint8 [B, 3, H, W] -> float ImageNet-normalised, on the network's device."""
        x = images_uint8.to(self.mean.device, non_blocking=True).float().div_(255.0)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def predict(self, images_uint8: Tensor) -> Tensor:
        """Foreground probability [B, S, S] in [0, 1] of uint8 images (eval mode is the caller's job)."""
        return torch.sigmoid(self(self.normalise(images_uint8))).squeeze(1).float()

"""A small generated view source with `pretrain.views.loader.ViewLoader`'s item format, for tests and smoke runs.

Each image is a smooth class pattern plus a smooth per-image pattern (so both instance
discrimination and kNN by class are learnable); each view is a random resized crop, flip and
brightness/contrast change of it. Everything is a pure function of (seed, epoch, image index, view
index), never of the rank layout: a global batch is the same images with the same views whether
it is served by one process or split over W ranks, which is what the distributed equality test
relies on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relicv2.pretrain.seeding import SeedPurpose, derive_seed
from relicv2.pretrain.views.config import ViewConfig
from relicv2.pretrain.views.source import GLOBAL_POSITION, batch_from_global_position


def _smooth_noise(seed: int, size: int, cells: int) -> Tensor:
    coarse = torch.randn(1, 3, cells, cells, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)[0]


@dataclass(eq=False)
class SyntheticViews:
    """Generated labelled images served as multi-view batches (a `ViewSource`), sharded over ranks like
    the ViewLoader; each epoch is a fresh seeded permutation."""

    num_images: int
    batch_size: int
    _: KW_ONLY
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    large_views: int = ViewConfig.large_views
    small_views: int = ViewConfig.small_views
    large_size: int = 32  # generated images are small: their views too
    small_size: int = 16
    num_classes: int = 10
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if self.num_images < self.batch_size * self.world_size:
            raise ValueError(f"{self.num_images} synthetic images cannot fill one global batch of "
                             f"{self.batch_size * self.world_size}")
        self.device = torch.device(self.device)
        self.epoch = 0
        self.position = 0  # batches of the current epoch already served
        classes = torch.stack([_smooth_noise(derive_seed(self.seed, SeedPurpose.SYNTHETIC_CLASS_PATTERN, c),
                                             self.large_size, 4) for c in range(self.num_classes)])
        self.labels = torch.arange(self.num_images) % self.num_classes
        seeds = [derive_seed(self.seed, SeedPurpose.SYNTHETIC_IMAGE_PATTERN, i)
                 for i in range(self.num_images)]
        self.images = torch.stack([classes[self.labels[i]] + 0.8 * _smooth_noise(seed, self.large_size, 6)
                                   for i, seed in enumerate(seeds)])

    @property
    def epoch_size(self) -> int:
        """Images per rank per epoch (`ViewSource.epoch_size`, the same meaning as `ViewLoader`'s)."""
        return self.num_images // self.world_size

    def __len__(self) -> int:
        """Full batches per rank and epoch: `epoch_size // batch_size`."""
        return self.epoch_size // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Its own `state_dict()`, or a global position (`pretrain.views.source.global_position_state`):
        the epoch order and the views do not depend on the number of ranks, so any split continues it."""
        if state.get("format") == GLOBAL_POSITION:
            self.epoch, self.position = batch_from_global_position(state, self.batch_size, self.world_size, len(self))
            return
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(self.num_images, generator=torch.Generator().manual_seed(derive_seed(self.seed, SeedPurpose.EPOCH_ORDER, self.epoch)))
        global_batch = self.batch_size * self.world_size
        while self.position < len(self):
            start = self.position * global_batch + self.rank * self.batch_size
            indices = order[start : start + self.batch_size].tolist()
            self.position += 1
            yield self._batch(indices)

    def _batch(self, indices: list[int]) -> dict[str, Any]:
        views: list[list[Tensor]] = [[] for _ in range(self.large_views + self.small_views)]
        for index in indices:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, SeedPurpose.VIEW_PARAMETERS, self.epoch, index))
            for v, view in enumerate(views):
                large = v < self.large_views
                size, area = (self.large_size, (0.35, 1.0)) if large else (self.small_size, (0.1, 0.35))
                view.append(self._view(self.images[index], generator, size=size, area=area))
        return {"views": [torch.stack(v).to(self.device) for v in views],
                "keys": [f"synthetic{index:06d}" for index in indices],
                "labels": self.labels[indices].to(self.device)}

    @staticmethod
    def _view(image: Tensor, generator: torch.Generator, *, size: int, area: tuple[float, float]) -> Tensor:
        side = image.shape[-1]
        u = torch.rand(6, generator=generator).tolist()
        crop = max(2, min(side, round(side * math.sqrt(area[0] + (area[1] - area[0]) * u[0]))))
        top = int(u[1] * (side - crop + 1))
        left = int(u[2] * (side - crop + 1))
        view = image[:, top : top + crop, left : left + crop].unsqueeze(0)
        view = F.interpolate(view, size=(size, size), mode="bilinear", align_corners=False)[0]
        if u[3] < 0.5:
            view = view.flip(-1)
        # brightness / contrast change, like a mild colour jitter
        return view * (0.7 + 0.6 * u[4]) + (u[5] - 0.5) * 0.6

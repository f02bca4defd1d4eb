"""A PNG grid of the augmented views of a few images, for checking the augmentations by eye."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from relicv2.pretrain.views.config import PARAM_NAMES, ViewConfig
from relicv2.pretrain.views.loader import ViewLoader

MASKED_BORDER = (255, 140, 0)  # orange frame around views whose background was masked
GAP = 4


def view_grid(views: list[torch.Tensor], masked: torch.Tensor, mean, std) -> Image.Image:
    """Rows = images, columns = views (large first); small views centred in large-size cells."""
    count, cell = views[0].shape[0], max(v.shape[-1] for v in views)
    grid = np.full((count * (cell + GAP) + GAP, len(views) * (cell + GAP) + GAP, 3), 255, np.uint8)
    m, s = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
    for j, batch in enumerate(views):
        size = batch.shape[-1]
        for i in range(count):
            pixels = ((batch[i].float().cpu() * s + m).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            top = GAP + i * (cell + GAP) + (cell - size) // 2
            left = GAP + j * (cell + GAP) + (cell - size) // 2
            if masked[i, j]:
                grid[top - 3 : top + size + 3, left - 3 : left + size + 3] = MASKED_BORDER
            grid[top : top + size, left : left + size] = pixels
    return Image.fromarray(grid)


def write_view_grid(shards: Path | str, output: Path | str, views: ViewConfig, *, count: int = 4, seed: int = 0) -> dict:
    """Write the L+S views of `count` images of a shard set as a PNG grid; returns a summary."""
    loader = ViewLoader(shards, count, dataclasses.replace(views, debug_params=True), seed=seed)
    batch = next(iter(loader))
    masked = batch["params"][:, :, PARAM_NAMES.index("masked")] > 0
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    view_grid(batch["views"], masked, loader.config.mean, loader.config.std).save(output)
    return {"output": str(output), "keys": batch["keys"], "masked_views": int(masked.sum()),
            "backend": loader.config.backend, "skipped": loader.skipped, "views": len(batch["views"])}

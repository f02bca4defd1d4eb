"""One image's saliency map from a trained network, with the test-time options a user can score
(mirror averaging, the dense CRF, averaging with the handcrafted maps)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from relicv2.saliency.batch import map_path
from relicv2.saliency.images import read_gray
from relicv2.saliency.network.config import CrfConfig
from relicv2.saliency.network.crf import dense_crf
from relicv2.saliency.network.images import resize_map, resize_square
from relicv2.saliency.network.model import SaliencyNet


def with_mirrors(batch: torch.Tensor) -> torch.Tensor:
    """N x C x H x W -> 2N: the batch, then each image mirrored left to right (one forward scores both)."""
    return torch.cat([batch, batch.flip(-1)])


def mirror_mean(probabilities: torch.Tensor) -> torch.Tensor:
    """2N x H x W predictions of `with_mirrors(batch)` -> N: each image's mean with its mirror's, mirrored back."""
    half = len(probabilities) // 2
    return (probabilities[:half] + probabilities[half:].flip(-1)) / 2


def predict_map(model: SaliencyNet, rgb: np.ndarray, size: int, *, flip: bool = False,
                crf: CrfConfig | None = None) -> np.ndarray:
    """The network's foreground probability of one displayed image (uint8 HxWx3), at the image's size;
    with `crf`, refined by the dense CRF on the network's input square first (`saliency.network.crf`)."""
    square = resize_square(rgb, size)
    batch = torch.from_numpy(square).permute(2, 0, 1)[None]
    probabilities = mirror_mean(model.predict(with_mirrors(batch))) if flip else model.predict(batch)
    probability = probabilities[0].cpu().numpy()
    if crf is not None:
        probability = dense_crf(square, probability, crf)
    return resize_map(probability, rgb.shape[1], rgb.shape[0])


def mean_of_maps(folder: Path, methods: Sequence[str], key: str) -> np.ndarray:
    """Per-pixel mean in [0, 1] of the maps ``folder/<method>/<key>.png`` of ``methods``."""
    return np.mean([read_gray(map_path(folder, m, key)) / 255.0 for m in methods], axis=0)


def with_maps(prediction: np.ndarray, maps_mean: np.ndarray) -> np.ndarray:
    """The mean of a network's prediction and the mean of the handcrafted maps (same HxW)."""
    if prediction.shape != maps_mean.shape:
        raise ValueError(f"prediction {prediction.shape} and maps {maps_mean.shape} differ in size")
    return (np.asarray(prediction, np.float64) + maps_mean) / 2.0

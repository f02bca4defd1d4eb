"""One training epoch of the saliency network, and the CRF worker pool that refines its predictions.

DeepUSPS keeps the train-mode predictions of the training pass itself (no extra forward pass):
`train_epoch` returns them, one probability map per image, for the CRF and the moving average.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from jobs.workers import worker_pool
from saliency.network.config import CrfConfig
from saliency.network.crf import dense_crf
from saliency.network.loss import refinement_loss
from saliency.network.model import SaliencyNet


def batches(order: Tensor, batch_size: int) -> list[Tensor]:
    """`order` cut into batches of `batch_size`; a last batch of one image joins the one before
    (BatchNorm in train mode cannot normalise a single image)."""
    parts = list(torch.split(order, batch_size))
    if len(parts) > 1 and len(parts[-1]) == 1:
        parts[-2:] = [torch.cat(parts[-2:])]
    return parts


def train_epoch(model: SaliencyNet, optimizer: torch.optim.Optimizer, images: Tensor,
                labels: Tensor, soft_maps: Tensor, *, order: Tensor, batch_size: int, beta2: float,
                device: str, progress=None) -> tuple[np.ndarray, float]:
    """Train one pass over `order`; return (train-mode predictions [N, S, S] float32, mean loss). labels and
    soft_maps [N, M, S, S]: M label sets (1 in phase I, one per method in phase II), the loss their mean."""
    model.train()
    predictions = np.zeros((images.shape[0], *images.shape[-2:]), dtype=np.float32)
    losses = []
    for index in batches(order, batch_size):
        probability = torch.sigmoid(model(model.normalise(images[index]))).squeeze(1)
        y = labels[index].to(device).float()
        m = soft_maps[index].to(device).float()
        per_label_set = [refinement_loss(probability, y[:, j], m[:, j], beta2) for j in range(y.shape[1])]
        loss = torch.stack(per_label_set).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        predictions[index.numpy()] = probability.detach().float().cpu().numpy()
        if progress is not None:
            progress.update(len(index))
    return predictions, float(np.mean(losses)) if losses else float("nan")


_WORK: dict = {}  # a CRF worker's images and settings, sent to it once (`_init_crf_worker`)


def _init_crf_worker(images: np.ndarray, config: CrfConfig) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _WORK.update(images=images, config=config)


def _crf_chunk(indices: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
    images, config = _WORK["images"], _WORK["config"]
    return np.stack([dense_crf(images[i], p, config) for i, p in zip(indices, probabilities, strict=True)])


class CrfPool:
    """Dense CRF over many images in worker processes; the images are sent to each worker once."""

    def __init__(self, images_hwc: np.ndarray, config: CrfConfig, workers: int):
        self.images, self.config, self.workers = images_hwc, config, workers
        # spawn: forking a process with torch's thread pools running can deadlock the child.
        self.pool = worker_pool(workers, start_method="spawn", initializer=_init_crf_worker,
                                initargs=(images_hwc, config)) if workers > 1 else None

    def refine(self, probabilities: np.ndarray) -> np.ndarray:
        """CRF-refined foreground probabilities [N, S, S] of `probabilities` [N, S, S]."""
        if self.pool is None:
            return np.stack([dense_crf(self.images[i], p, self.config) for i, p in enumerate(probabilities)])
        chunks = np.array_split(np.arange(len(probabilities)), self.workers * 4)
        futures = [self.pool.submit(_crf_chunk, c, probabilities[c]) for c in chunks if len(c)]
        return np.concatenate([f.result() for f in futures])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

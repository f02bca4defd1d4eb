"""One training epoch of the saliency network (the CRF worker pool that refines its predictions: `crf.CrfPool`).

DeepUSPS keeps the train-mode predictions of the training pass itself (no extra forward pass):
`train_epoch` returns them, one probability map per image, for the CRF and the moving average.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from relicv2.saliency.network.loss import refinement_loss
from relicv2.saliency.network.model import SaliencyNet


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

"""The refinement loss: 1 - continuous F-measure per image, after DeepUSPS's soft thresholding. Pure
functions of tensors whose first axis is the image: probabilities in [0, 1], labels binary {0, 1}.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-7


def soft_threshold(prediction: Tensor, label: Tensor, soft_map: Tensor) -> Tensor:
    """The prediction the loss sees (DeepUSPS reference code, "soft thresholding").

    Where the binary label is 1 and the prediction already exceeds the soft map the label was
    binarised from, the prediction counts as 1; where the label is 0 and the prediction is already
    below that map, it counts as 0. Those pixels then add no gradient: the network is not pushed
    to copy the noisy map's exact values where it already agrees with the label's side.
    """
    positive = (label > 0.5) & (prediction > soft_map)
    negative = (label <= 0.5) & (prediction < soft_map)
    return torch.where(positive, 1.0, torch.where(negative, 0.0, prediction))


def f_measure(prediction: Tensor, label: Tensor, beta2: float = 1.0) -> Tensor:
    """Continuous F-measure per image [B]: TP = sum p y, FP = sum p (1 - y), FN = sum (1 - p) y."""
    p = prediction.flatten(1).float()
    y = label.flatten(1).float()
    tp = (p * y).sum(1)
    fp = (p * (1 - y)).sum(1)
    fn = ((1 - p) * y).sum(1)
    return (1 + beta2) * tp / ((1 + beta2) * tp + beta2 * fn + fp + EPS)


def refinement_loss(prediction: Tensor, label: Tensor, soft_map: Tensor, beta2: float = 1.0) -> Tensor:
    """Mean over images of 1 - F(soft_threshold(prediction), label)."""
    return (1.0 - f_measure(soft_threshold(prediction, label, soft_map), label, beta2)).mean()

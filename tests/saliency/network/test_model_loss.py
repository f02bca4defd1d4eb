"""The network's shapes and range, the refinement loss and DeepUSPS's soft thresholding."""

from __future__ import annotations

import pytest
import torch

from relicv2.saliency.network.loss import f_measure, refinement_loss, soft_threshold
from relicv2.saliency.network.model import SaliencyNet


@pytest.mark.parametrize("depth", [18, 50])
def test_network_output_shape_range_and_stride(depth: int) -> None:
    torch.manual_seed(0)
    model = SaliencyNet(depth).eval()
    images = torch.randint(0, 256, (2, 3, 48, 48), dtype=torch.uint8)
    logits = model(model.normalise(images))
    assert logits.shape == (2, 1, 48, 48)
    assert torch.isfinite(logits).all()
    probability = model.predict(images)
    assert probability.shape == (2, 48, 48)
    assert probability.min() >= 0 and probability.max() <= 1
    # Dilated last stages: the encoder's output stride is 8, not 32.
    e = model.encoder
    deep = e.layer4(e.layer3(e.layer2(e.layer1(e.maxpool(e.relu(e.bn1(e.conv1(model.normalise(images)))))))))
    assert deep.shape[-2:] == (6, 6)


def test_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(0)
    model = SaliencyNet(18)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    torch.sigmoid(model(model.normalise(images))).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_f_measure_hand_computed() -> None:
    label = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    prediction = torch.tensor([[1.0, 0.5, 0.5, 0.0]])
    # TP = 1.5, FP = 0.5, FN = 0.5; beta^2 = 1: F = 2 TP / (2 TP + FN + FP) = 3 / 4
    assert f_measure(prediction, label, 1.0).item() == pytest.approx(0.75, abs=1e-6)
    # beta^2 = 4: 5 TP / (5 TP + 4 FN + FP) = 7.5 / 10
    assert f_measure(prediction, label, 4.0).item() == pytest.approx(0.75, abs=1e-6)
    prediction = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # TP 1, FP 2, FN 1
    assert f_measure(prediction, label, 4.0).item() == pytest.approx(5 / (5 + 4 + 2), abs=1e-6)


def test_loss_perfect_and_worst_cases() -> None:
    label = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    soft = torch.full_like(label, 0.5)
    assert refinement_loss(label.clone(), label, soft).item() == pytest.approx(0.0, abs=1e-6)
    assert refinement_loss(1 - label, label, soft).item() == pytest.approx(1.0, abs=1e-6)


def test_soft_threshold_rules() -> None:
    label = torch.tensor([1.0, 1.0, 0.0, 0.0])
    soft_map = torch.tensor([0.6, 0.6, 0.3, 0.3])
    prediction = torch.tensor([0.7, 0.5, 0.2, 0.4], requires_grad=True)
    seen = soft_threshold(prediction, label, soft_map)
    # label 1 and above the map -> 1; label 1 below -> kept; label 0 below the map -> 0; above -> kept
    assert seen.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.4])
    seen.sum().backward()
    assert prediction.grad.tolist() == [0.0, 1.0, 0.0, 1.0]  # agreeing pixels give no gradient


def test_loss_decreases_under_training() -> None:
    torch.manual_seed(0)
    model = SaliencyNet(18)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    label = torch.zeros(2, 32, 32)
    label[:, 8:24, 8:24] = 1
    soft = label * 0.8 + 0.1
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    losses = []
    for _ in range(10):
        loss = refinement_loss(torch.sigmoid(model(model.normalise(images))).squeeze(1), label, soft)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1

"""Schedules, the EMA update and LARS against their formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from relicv2.models.heads import MLP, OnlineNetwork, TargetNetwork, build_networks, ema_update
from relicv2.pretrain.config import derive, load_config
from relicv2.pretrain.lars import LARS, parameter_groups
from relicv2.pretrain.schedules import ema_coefficient, learning_rate, peak_learning_rate

LR = {"peak_lr": peak_learning_rate(0.3, 4096), "warmup_steps": 100, "total_steps": 1000}


def test_learning_rate_schedule_values() -> None:
    peak = 0.3 * 4096 / 256  # 4.8
    assert learning_rate(0, **LR) == 0.0
    assert learning_rate(50, **LR) == pytest.approx(peak / 2)
    assert learning_rate(100, **LR) == pytest.approx(peak)  # warmup end
    assert learning_rate(550, **LR) == pytest.approx(peak / 2)  # half-way through the cosine
    assert learning_rate(1000, **LR) == pytest.approx(0.0, abs=1e-12)  # end
    assert learning_rate(2000, **LR) == pytest.approx(0.0, abs=1e-12)
    values = [learning_rate(step, **LR) for step in range(100, 1001)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_learning_rate_without_warmup_and_bad_arguments() -> None:
    assert learning_rate(0, peak_lr=1.0, warmup_steps=0, total_steps=10) == 1.0
    with pytest.raises(ValueError, match="warmup_steps"):
        learning_rate(0, peak_lr=1.0, warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="finite"):
        learning_rate(0, peak_lr=float("nan"), warmup_steps=0, total_steps=10)


def test_the_printed_peak_lr_is_the_one_the_schedule_reaches() -> None:
    config = load_config(None, ["optim.base_lr=0.25", "optim.global_batch=512", "optim.epochs=10",
                                "optim.warmup_epochs=1"])
    derived = derive(config, world_size=1, dataset_size=5120)
    assert derived.peak_lr == pytest.approx(0.5)
    reached = learning_rate(derived.warmup_steps, peak_lr=derived.peak_lr, warmup_steps=derived.warmup_steps,
                            total_steps=derived.total_steps)
    assert reached == derived.peak_lr


def test_ema_coefficient_values() -> None:
    assert ema_coefficient(0, base=0.996, total_steps=1000) == pytest.approx(0.996)
    assert ema_coefficient(500, base=0.996, total_steps=1000) == pytest.approx(0.998)
    assert ema_coefficient(1000, base=0.996, total_steps=1000) == pytest.approx(1.0)
    k = 250
    expected = 1 - (1 - 0.996) * (math.cos(math.pi * k / 1000) + 1) / 2
    assert ema_coefficient(k, base=0.996, total_steps=1000) == pytest.approx(expected)


def _tiny_networks() -> tuple[OnlineNetwork, TargetNetwork]:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))
    online = OnlineNetwork(encoder, MLP(5, 8, 4), MLP(4, 8, 4))
    target = TargetNetwork(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)), MLP(5, 8, 4))
    target.requires_grad_(False)
    online(torch.randn(8, 6))  # train-mode forward: online BN running statistics move
    return online, target


def test_ema_update_averages_parameters_and_copies_buffers() -> None:
    online, target = _tiny_networks()
    before = {name: t.clone() for name, t in target.state_dict().items()}
    predictor_before = {name: t.clone() for name, t in online.predictor.state_dict().items()}
    ema_update(target, online, 0.9)
    online_state = online.state_dict()
    for name, param in target.named_parameters():
        torch.testing.assert_close(param, 0.9 * before[name] + 0.1 * online_state[name])
    for name, buffer in target.named_buffers():
        torch.testing.assert_close(buffer, online_state[name])
    for name, tensor in online.predictor.state_dict().items():
        assert torch.equal(tensor, predictor_before[name])


def test_ema_update_with_coefficient_one_keeps_the_parameters() -> None:
    online, target = _tiny_networks()
    before = {name: p.clone() for name, p in target.named_parameters()}
    ema_update(target, online, 1.0)
    for name, param in target.named_parameters():
        assert torch.equal(param, before[name])
    with pytest.raises(ValueError, match="coefficient"):
        ema_update(target, online, 1.5)


def test_ema_update_on_built_networks_moves_target_halfway() -> None:
    online, target = build_networks(18, 1, hidden_dim=16, out_dim=8)
    online_params = list(online.encoder.parameters()) + list(online.projector.parameters())
    with torch.no_grad():
        for p in online_params:
            p.add_(torch.randn_like(p))
        start = [t.clone() for t in target.parameters()]
    ema_update(target, online, 0.5)
    for t, t0, o in zip(target.parameters(), start, online_params, strict=True):
        torch.testing.assert_close(t, 0.5 * t0 + 0.5 * o.detach())


def test_parameter_groups_split_by_module_type_and_rank() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    adapted, excluded = parameter_groups(model, weight_decay=1e-6)
    assert adapted["weight_decay"] == 1e-6 and not adapted["lars_exclude"]
    assert excluded["weight_decay"] == 0.0 and excluded["lars_exclude"]
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    assert ids(adapted["params"]) == {id(model[0].weight), id(model[3].weight)}
    assert ids(excluded["params"]) == {id(model[0].bias), id(model[1].weight), id(model[1].bias),
                                       id(model[3].bias)}


def test_parameter_groups_on_a_resnet_exclude_every_batchnorm() -> None:
    online, _ = build_networks(18, 1, hidden_dim=16, out_dim=8)
    adapted, excluded = parameter_groups(online, weight_decay=1.5e-6)
    norm_params = {id(p) for m in online.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                   for p in m.parameters()}
    assert norm_params <= {id(p) for p in excluded["params"]}
    assert all(p.ndim >= 2 for p in adapted["params"])
    assert len(adapted["params"]) + len(excluded["params"]) == len(list(online.parameters()))


def _direct_lars(params, grads_per_step, lrs, *, momentum, weight_decay, trust, excluded):
    """LARS written out per tensor from the formula (BYOL's reference optimizer)."""
    params = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    for grads, lr in zip(grads_per_step, lrs, strict=True):
        for index, (p, g) in enumerate(zip(params, grads, strict=True)):
            if excluded[index]:
                u = g
            else:
                u = g + weight_decay * p
                pn, un = p.norm().item(), u.norm().item()
                u = u * (trust * pn / un if pn > 0 and un > 0 else 1.0)
            buffers[index] = momentum * buffers[index] + u
            params[index] = p - lr * buffers[index]
    return params


def test_lars_matches_the_direct_formula() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2, bias=False))
    with torch.no_grad():
        model[2].weight.zero_()  # zero norm: trust ratio falls back to 1
    groups = parameter_groups(model, weight_decay=0.01)
    optimizer = LARS(groups, lr=0.1, momentum=0.9, trust_coefficient=1e-3)
    ordered = [p for group in groups for p in group["params"]]
    excluded = [group["lars_exclude"] for group in groups for _ in group["params"]]
    initial = [p.detach().clone() for p in ordered]
    grads_per_step, lrs = [], [0.1, 0.3, 0.2]
    for lr in lrs:
        grads = [torch.randn_like(p) for p in ordered]
        for p, g in zip(ordered, grads, strict=True):
            p.grad = g.clone()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        grads_per_step.append(grads)
    expected = _direct_lars(initial, grads_per_step, lrs, momentum=0.9, weight_decay=0.01,
                            trust=1e-3, excluded=excluded)
    for got, want in zip(ordered, expected, strict=True):
        torch.testing.assert_close(got.detach(), want)
    # The excluded group really took the plain momentum-SGD path (much larger steps than 1e-3 trust).
    bn_weight = model[1].weight
    assert (bn_weight.detach() - 1.0).abs().max() > 1e-2


def test_lars_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="momentum"):
        LARS(nn.Linear(2, 2).parameters(), lr=0.1, momentum=1.5)

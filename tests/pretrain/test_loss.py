"""ReLICv2 loss: a hand-computed value, agreement with a per-anchor loop over the paper's
equations, gradient placement, negative sampling, multi-rank semantics, and an SGD decrease."""

from __future__ import annotations

import itertools
import math
import socket

import pytest
import torch
import torch.nn.functional as F

from relicv2.pretrain.loss import gather_with_grad, relicv2_loss, sample_negatives

SETTINGS = {"temperature": 0.2, "contrast_weight": 0.3, "invariance_weight": 2.0}


def _views(count: int, rows: int, dim: int, seed: int, grad: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=g).requires_grad_(grad) for _ in range(count)]


def _reference_loss(online_large, online_small, target_large, *, temperature, contrast_weight,
                    invariance_weight, candidates=None, anchor_offset=0, gathered_online=None):
    """Plain loop over pairs and anchors, written from the paper's eq. 1, 2 and 4.

    candidates(pair, i) -> list of gathered row indices with the positive first; by default
    the anchor followed by every other image.
    """
    online_views = list(online_large) + list(online_small)
    gathered = online_views if gathered_online is None else list(gathered_online)
    total = target_large[0].shape[0]
    contrastive_sum, invariance_sum, count = 0.0, 0.0, 0
    for pair, (a, b) in enumerate(itertools.product(range(len(online_views)), range(len(target_large)))):
        o_local = F.normalize(online_views[a], dim=-1)
        o_all = F.normalize(gathered[a], dim=-1)
        t = F.normalize(target_large[b].detach(), dim=-1)
        for i in range(o_local.shape[0]):
            anchor = anchor_offset + i
            if candidates is None:
                cand = [anchor] + [j for j in range(total) if j != anchor]
            else:
                cand = candidates(pair, i)
            forward = torch.stack([o_local[i] @ t[j] for j in cand]) / temperature
            reverse = torch.stack([o_all[j] @ t[anchor] for j in cand]) / temperature
            p = torch.softmax(forward, 0)
            q = torch.softmax(reverse, 0)
            contrastive_sum = contrastive_sum - torch.log(p[0])
            kl = (p * torch.log(p)).sum().detach() - (p * torch.log(q)).sum()
            invariance_sum = invariance_sum + kl
            count += 1
    contrastive, invariance = contrastive_sum / count, invariance_sum / count
    return contrast_weight * contrastive + invariance_weight * invariance, contrastive, invariance


@pytest.mark.parametrize("large, small", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_matches_per_anchor_loop_with_all_negatives(large: int, small: int) -> None:
    batch, dim = 6, 5
    online_large = _views(large, batch, dim, seed=1)
    online_small = _views(small, batch, dim, seed=2)
    target_large = _views(large, batch, dim, seed=3, grad=False)
    loss, parts = relicv2_loss(online_large, online_small, target_large,
                               num_negatives=batch - 1, **SETTINGS)
    expected, contrastive, invariance = _reference_loss(online_large, online_small, target_large, **SETTINGS)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(parts["contrastive"], contrastive)
    torch.testing.assert_close(parts["invariance"], invariance)
    online = online_large + online_small
    grads = torch.autograd.grad(loss, online)
    expected_grads = torch.autograd.grad(expected, online)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
        assert got.abs().sum() > 0


def test_hand_computed_value() -> None:
    # o = [[1, 0], [0, 1]], t = [[1, 0], [1, 0]], tau = 1, one view each.
    # Anchor 0: forward logits (<o0,t0>, <o0,t1>) = (1, 1) -> p = (1/2, 1/2), contrastive = log 2;
    #           reverse logits (<o0,t0>, <o1,t0>) = (1, 0) -> q = (e, 1) / (1 + e);
    #           KL = log(1/2) - (1/2)(log q0 + log q1) = -log 2 - 1/2 + log(1 + e).
    # Anchor 1: forward (<o1,t1>, <o1,t0>) = (0, 0) -> p = (1/2, 1/2); reverse (<o1,t1>, <o0,t1>)
    #           = (0, 1) -> q = (1, e) / (1 + e): the same KL by symmetry.
    o = [torch.tensor([[1.0, 0.0], [0.0, 1.0]])]
    t = [torch.tensor([[1.0, 0.0], [1.0, 0.0]])]
    kl = -math.log(2) - 0.5 + math.log(1 + math.e)
    loss, parts = relicv2_loss(o, [], t, temperature=1.0, num_negatives=1,
                               contrast_weight=0.5, invariance_weight=2.0)
    assert parts["contrastive"].item() == pytest.approx(math.log(2), abs=1e-6)
    assert parts["invariance"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * math.log(2) + 2.0 * kl, abs=1e-6)  # 0.586804...


def test_subsampled_negatives_match_loop_on_the_same_candidates() -> None:
    batch, dim, large, small, negatives = 9, 4, 2, 1, 3
    online_large = _views(large, batch, dim, seed=4)
    online_small = _views(small, batch, dim, seed=5)
    target_large = _views(large, batch, dim, seed=6, grad=False)
    generator = torch.Generator().manual_seed(7)
    replay = torch.Generator().manual_seed(7)
    loss, _ = relicv2_loss(online_large, online_small, target_large, num_negatives=negatives,
                           generator=generator, **SETTINGS)
    drawn = sample_negatives(batch, negatives, (large + small) * large, generator=replay)
    expected, _, _ = _reference_loss(
        online_large, online_small, target_large, **SETTINGS,
        candidates=lambda pair, i: [i] + drawn[pair, i].tolist(),
    )
    torch.testing.assert_close(loss, expected)
    # Subsampling really changes the loss (the test above is not the all-negatives case).
    full, _ = relicv2_loss(online_large, online_small, target_large, num_negatives=batch - 1, **SETTINGS)
    assert not torch.allclose(loss, full)


def test_sampled_candidates_exclude_the_anchor_and_are_distinct() -> None:
    drawn = sample_negatives(40, 10, 16, generator=torch.Generator().manual_seed(0))
    assert drawn.shape == (16, 40, 10)
    rows = torch.arange(40).view(1, 40, 1)
    assert not (drawn == rows).any()
    assert ((drawn >= 0) & (drawn < 40)).all()
    sorted_drawn = drawn.sort(dim=-1).values
    assert (sorted_drawn[..., 1:] != sorted_drawn[..., :-1]).all()


def test_sampled_subsets_are_uniform() -> None:
    # Row 0 of a batch of 5 with 2 negatives: the 6 subsets of {1, 2, 3, 4} are equally likely.
    draws = 30_000
    drawn = sample_negatives(5, 2, draws, generator=torch.Generator().manual_seed(1))[:, 0]
    pairs = drawn.sort(dim=-1).values
    codes = pairs[:, 0] * 5 + pairs[:, 1]
    counts = torch.bincount(codes, minlength=25)[[7, 8, 9, 13, 14, 19]].double()
    assert counts.sum() == draws
    expected = draws / 6
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.7  # p = 1e-4 for 5 degrees of freedom


def test_all_negatives_is_deterministic() -> None:
    online, target = _views(2, 6, 4, seed=8), _views(2, 6, 4, seed=9, grad=False)
    first, _ = relicv2_loss(online, [], target, num_negatives=5, **SETTINGS,
                            generator=torch.Generator().manual_seed(0))
    second, _ = relicv2_loss(online, [], target, num_negatives=50, **SETTINGS,
                             generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(first, second)


def test_only_online_inputs_get_gradients() -> None:
    online_large, online_small = _views(2, 6, 4, seed=10), _views(1, 6, 4, seed=11)
    target_large = _views(2, 6, 4, seed=12, grad=True)  # gradients requested, must not flow
    loss, _ = relicv2_loss(online_large, online_small, target_large, num_negatives=3,
                           generator=torch.Generator().manual_seed(0), **SETTINGS)
    loss.backward()
    assert all(t.grad is None for t in target_large)
    assert all(o.grad is not None and o.grad.abs().sum() > 0 for o in online_large + online_small)


def test_entropy_term_carries_no_gradient() -> None:
    # With the paper's sg[.] on sum p log p, the invariance gradient is the gradient of the
    # cross term -sum p(a;b) log p(b;a) alone, and differs from that of the full KL.
    online, target = _views(1, 5, 3, seed=13), _views(1, 5, 3, seed=14, grad=False)
    _, parts = relicv2_loss(online, [], target, num_negatives=4, **SETTINGS)
    (grad,) = torch.autograd.grad(parts["invariance"], online)

    def terms() -> tuple[torch.Tensor, torch.Tensor]:
        o, t = F.normalize(online[0], dim=-1), F.normalize(target[0], dim=-1)
        log_p = torch.log_softmax(o @ t.T / SETTINGS["temperature"], dim=1)
        log_q = torch.log_softmax(t @ o.T / SETTINGS["temperature"], dim=1)
        return (log_p.exp() * log_p).sum(1).mean(), -(log_p.exp() * log_q).sum(1).mean()

    entropy, cross = terms()
    (cross_grad,) = torch.autograd.grad(cross, online, retain_graph=True)
    torch.testing.assert_close(grad, cross_grad)
    (entropy_grad,) = torch.autograd.grad(entropy, online)
    assert entropy_grad.abs().max() > 1e-3  # without sg the gradient would differ


def test_fp32_under_bf16_autocast() -> None:
    online = [v.detach().bfloat16() for v in _views(2, 8, 16, seed=15)]
    target = [v.bfloat16() for v in _views(2, 8, 16, seed=16, grad=False)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, parts = relicv2_loss(online, [], target, num_negatives=7, **SETTINGS)
    expected, _ = relicv2_loss([v.float() for v in online], [], [v.float() for v in target],
                               num_negatives=7, **SETTINGS)
    assert loss.dtype == torch.float32 and parts["invariance"].dtype == torch.float32
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("num_negatives", [3, 7])
def test_ranks_emulated_by_anchor_offset_match_one_process(num_negatives: int) -> None:
    # Two "ranks" of 4 anchors each, seeing the gathered batch of 8: the mean of their losses is
    # the loss of one process with batch 8, with all negatives and with subsampled ones (same
    # generator seed on every rank).
    world, batch, dim, large, small = 2, 4, 5, 2, 1
    online_all = _views(large + small, world * batch, dim, seed=17)
    target = _views(large, world * batch, dim, seed=18, grad=False)
    kwargs = dict(num_negatives=num_negatives, **SETTINGS)
    single, _ = relicv2_loss(online_all[:large], online_all[large:], target,
                             generator=torch.Generator().manual_seed(3), **kwargs)
    rank_losses = []
    for rank in range(world):
        local = [v[rank * batch:(rank + 1) * batch] for v in online_all]
        loss, _ = relicv2_loss(local[:large], local[large:], target, anchor_offset=rank * batch,
                               gathered_online=online_all,
                               generator=torch.Generator().manual_seed(3), **kwargs)
        rank_losses.append(loss)
    mean = torch.stack(rank_losses).mean()
    torch.testing.assert_close(mean, single)
    torch.testing.assert_close(torch.autograd.grad(mean, online_all),
                               torch.autograd.grad(single, online_all))


def test_gathered_batch_without_gathered_online_is_an_error() -> None:
    with pytest.raises(ValueError, match="gather_with_grad"):
        relicv2_loss(_views(1, 4, 3, seed=0), [], _views(1, 8, 3, seed=1, grad=False),
                     num_negatives=3, **SETTINGS)


def test_loss_decreases_under_sgd() -> None:
    torch.manual_seed(0)
    images = torch.randn(16, 8)
    online = torch.nn.Linear(8, 6)
    target = torch.nn.Linear(8, 6).requires_grad_(False)
    optimizer = torch.optim.SGD(online.parameters(), lr=0.5)
    noise = torch.Generator().manual_seed(1)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(30):
        views = [images + 0.1 * torch.randn(images.shape, generator=noise) for _ in range(3)]
        loss, _ = relicv2_loss([online(v) for v in views[:2]], [online(views[2])],
                               [target(v) for v in views[:2]], num_negatives=5,
                               generator=generator, **SETTINGS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batch = 3
        online_all = _views(3, world * batch, 4, seed=20)
        target = _views(2, world * batch, 4, seed=21, grad=False)
        local = [v[rank * batch:(rank + 1) * batch].detach().requires_grad_(True) for v in online_all]
        gathered = [gather_with_grad(v) for v in local]
        loss, _ = relicv2_loss(local[:2], local[2:], target, anchor_offset=rank * batch,
                               gathered_online=gathered, num_negatives=2,
                               generator=torch.Generator().manual_seed(5), **SETTINGS)
        loss.backward()
        torch.save({"loss": loss.item(), "grads": [v.grad for v in local]}, out / f"rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path, rank_pair) -> None:
    world, batch = 2, 3
    rank_pair.run(_rank_worker, world, _free_port(), tmp_path)
    saved = {rank: torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(world)}
    outputs = {rank: (entry["loss"], entry["grads"]) for rank, entry in saved.items()}
    online_all = _views(3, world * batch, 4, seed=20)
    target = _views(2, world * batch, 4, seed=21, grad=False)
    single, _ = relicv2_loss(online_all[:2], online_all[2:], target, num_negatives=2,
                             generator=torch.Generator().manual_seed(5), **SETTINGS)
    single_grads = torch.autograd.grad(single, online_all)
    assert sum(loss for loss, _ in outputs.values()) / world == pytest.approx(single.item(), rel=1e-5)
    for rank, (_, grads) in outputs.items():
        for got, full in zip(grads, single_grads, strict=True):
            # Each rank's rows get the gradient of the *sum* of rank losses; DDP then averages
            # over ranks, which gives the single-process gradient of the mean loss.
            torch.testing.assert_close(got / world, full[rank * batch:(rank + 1) * batch])

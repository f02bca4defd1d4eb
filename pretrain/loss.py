"""The ReLICv2 objective (paper eq. 2 and 4, pseudo-code listing 1) as a pure function of tensors, in the
notation of docs/design.md "Loss" (candidates c_i: anchor i's positive c_i0 = i, then its n_e negatives).
The stop-gradient sits on the entropy term only, as in the paper's eq. 2: the cross term keeps the
gradient through both the weights p(a;b) and log p(b;a).

Multi-rank runs. The negatives come from the global batch of N = world * B images, so
`target_large` holds the targets gathered from all ranks ([N, D], no gradient needed), and the
local anchor i is global row `anchor_offset + i` (anchor_offset = rank * B). The reverse
distribution p(b;a) scores the *online* embeddings of the candidates, which live on other
ranks; they are passed in `gathered_online`, produced with `gather_with_grad`, whose backward
sends each rank the gradient that every rank's loss puts on its rows. With DDP's gradient
averaging, W ranks then produce exactly the gradient of one process with batch W * B (the mean
of the W rank losses equals that process's loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward sums the gradient over ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # type: ignore[override]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        ctx.rows = slice(dist.get_rank() * tensor.shape[0], (dist.get_rank() + 1) * tensor.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        # Every rank's loss depends on every rank's rows (through p(b;a)), so the gradient of the
        # summed rank losses w.r.t. this rank's rows is the sum over ranks of their gradients.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rows]


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate `tensor` [B, ...] from all ranks in rank order ([world * B, ...]), keeping gradients.
    Returns `tensor` itself when torch.distributed is not initialised or the world has one rank. Every rank
    must call it with the same shape, in the same order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


def sample_negatives(batch_size: int, num_negatives: int, num_draws: int, *,
                     generator: torch.Generator | None = None,
                     device: torch.device | str | None = None) -> Tensor:
    """Indices [num_draws, batch_size, num_negatives]: for each draw and row i, `num_negatives` distinct
    indices from {0..batch_size-1} \\ {i}, uniformly without replacement, drawn from `generator` (on its
    device), then moved to `device`. Cost O(num_draws * batch_size * num_negatives^2), never a [batch_size,
    batch_size] matrix: Floyd's algorithm (Bentley & Floyd 1987), vectorised over rows and draws, picks a
    uniform num_negatives-subset of {0..batch_size-2}; shifting values >= i up by one skips row i."""
    others = batch_size - 1
    if not 1 <= num_negatives <= others:
        raise ValueError(f"need 1 <= num_negatives <= batch_size - 1 = {others}, got {num_negatives}")
    draw_device = generator.device if generator is not None else device
    chosen = torch.empty(num_draws, batch_size, num_negatives, dtype=torch.long, device=draw_device)
    for k, j in enumerate(range(others - num_negatives, others)):
        pick = torch.randint(0, j + 1, (num_draws, batch_size), generator=generator, device=draw_device)
        # j itself cannot be taken yet (earlier picks are <= j - 1), so a repeat is replaced by j.
        repeated = (chosen[..., :k] == pick.unsqueeze(-1)).any(dim=-1)
        chosen[..., k] = torch.where(repeated, torch.full_like(pick, j), pick)
    rows = torch.arange(batch_size, device=draw_device).view(1, batch_size, 1)
    return (chosen + (chosen >= rows).long()).to(device if device is not None else draw_device)


def relicv2_loss(online_large: Sequence[Tensor], online_small: Sequence[Tensor],
                 target_large: Sequence[Tensor], *, temperature: float, num_negatives: int,
                 contrast_weight: float, invariance_weight: float, generator: torch.Generator | None = None,
                 anchor_offset: int = 0,
                 gathered_online: Sequence[Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """ReLICv2 loss over all large x large and small x large (online, target) view pairs.

    online_large: L tensors [B, D] (local batch), online_small: S tensors [B, D] (may be empty),
    target_large: L tensors [N, D] gathered over ranks (N = B in one process); none normalised.
    Local anchor i is gathered row `anchor_offset + i`. `gathered_online`: the L + S online
    views (large first) gathered with `gather_with_grad`, required when N > B.

    Negatives: for each pair p = a * L + b (online view a, large first, against target view b) a
    fresh `sample_negatives(N, num_negatives, (L + S) * L, generator=generator)` draw is made for
    all N rows and this rank's rows are used, so every rank must hold the generator in the same
    state. num_negatives >= N - 1 uses all other images and draws nothing.

    Memory: with subsampled negatives, two gathered candidate tensors of (L + S) * L * B *
    (1 + n_e) rows of D floats, no [B, N] similarity matrix; with all negatives, [B, N] per pair.

    Returns (loss, {"contrastive", "invariance"}), each the mean over anchors and pairs (the
    paper's sum over pairs divided by (L + S) * L), with
    loss = contrast_weight * contrastive + invariance_weight * invariance. Computed in fp32.
    """
    online_views = list(online_large) + list(online_small)
    _check_inputs(online_large, online_views, target_large, gathered_online, anchor_offset)
    batch, total = online_views[0].shape[0], target_large[0].shape[0]
    device = online_views[0].device
    # Softmax over similarities at temperature 0.2 loses too much in bf16: always fp32.
    with torch.autocast(device_type=device.type, enabled=False):
        online = F.normalize(torch.stack(online_views).float(), dim=-1)  # [V, B, D]
        candidates_online = online if gathered_online is None else F.normalize(  # [V, N, D]
            torch.stack(list(gathered_online)).float(), dim=-1)
        target = F.normalize(torch.stack(list(target_large)).detach().float(), dim=-1)  # [L, N, D]
        anchors = torch.arange(anchor_offset, anchor_offset + batch, device=device)
        target_anchor = target[:, anchors]  # [L, B, D]
        num_online, num_target = len(online_views), len(target_large)
        anchor_columns = anchors.view(1, 1, batch, 1).expand(num_online, num_target, -1, -1)  # [V, L, B, 1]
        if num_negatives >= total - 1:
            # All candidates: column j of both [V, L, B, N] matrices is candidate image j.
            forward_logits = torch.einsum("abd,lnd->albn", online, target)
            reverse_logits = torch.einsum("lbd,and->albn", target_anchor, candidates_online)
            positive = anchor_columns
        else:
            negatives = sample_negatives(total, num_negatives, num_online * num_target, generator=generator,
                                         device=device).view(num_online, num_target, total, num_negatives)
            candidates = torch.cat([anchor_columns, negatives[:, :, anchors]], dim=-1)  # [V, L, B, 1 + n_e]
            # forward <o_a[i], t_b[c]> and reverse <o_a[c], t_b[i]> (the candidates' views first, then back)
            forward_logits = _candidate_dots(target, online, candidates)
            reverse_logits = _candidate_dots(candidates_online, target_anchor,
                                             candidates.transpose(0, 1)).transpose(0, 1)
            positive = torch.zeros_like(candidates[..., :1])  # column 0 is the anchor itself
        contrastive, invariance = _relic_terms(forward_logits / temperature, reverse_logits / temperature, positive)
        loss = contrast_weight * contrastive + invariance_weight * invariance
    return loss, {"contrastive": contrastive, "invariance": invariance}


def _candidate_dots(table: Tensor, fixed: Tensor, candidates: Tensor) -> Tensor:
    """<fixed[f, i], table[t, candidates[f, t, i, k]]> for all f, t, i, k: [F, T, B, K] from table [T, N, D]
    and fixed [F, B, D]. The candidate rows are gathered once with `index_select` on the flattened views (its
    backward is a fast `index_add_`, unlike advanced indexing's `index_put_`) and laid out so that one `bmm`
    against the fixed vectors computes every logit without copies."""
    num_fixed, num_table, batch, count = candidates.shape
    total, dim = table.shape[1], table.shape[2]
    # row (f, i), candidate (t, k) indexes table row t * N + c
    rows = candidates + total * torch.arange(num_table, device=candidates.device).view(1, -1, 1, 1)
    rows = rows.permute(0, 2, 1, 3).reshape(-1)  # [F, B, T, K]
    gathered = table.reshape(-1, dim).index_select(0, rows).view(num_fixed * batch, num_table * count, dim)
    dots = torch.bmm(gathered, fixed.reshape(num_fixed * batch, dim, 1))
    return dots.view(num_fixed, batch, num_table, count).permute(0, 2, 1, 3)


def _relic_terms(forward_logits: Tensor, reverse_logits: Tensor, positive: Tensor) -> tuple[Tensor, Tensor]:
    """Mean contrastive and invariance (KL) terms from candidate logits [..., K]."""
    log_p = F.log_softmax(forward_logits, dim=-1)  # log p(a;b)
    log_q = F.log_softmax(reverse_logits, dim=-1)  # log p(b;a)
    p = log_p.exp()
    contrastive = -log_p.gather(-1, positive).squeeze(-1)
    negative_entropy = (p * log_p).sum(dim=-1).detach()  # the paper's sg[.]
    invariance = negative_entropy - (p * log_q).sum(dim=-1)
    return contrastive.mean(), invariance.mean()


def _check_inputs(online_large: Sequence[Tensor], online_views: list[Tensor], target_large: Sequence[Tensor],
                  gathered_online: Sequence[Tensor] | None, anchor_offset: int) -> None:
    if len(online_large) == 0 or len(target_large) != len(online_large):
        raise ValueError(f"need L >= 1 large views in both networks, got {len(online_large)} online and "
                         f"{len(target_large)} target")
    batch, dim = online_views[0].shape
    total = target_large[0].shape[0]
    if any(o.shape != (batch, dim) for o in online_views):
        raise ValueError(f"all online views must be [B, D] = [{batch}, {dim}]")
    if any(t.shape != (total, dim) for t in target_large):
        raise ValueError(f"all target views must be [N, D] with the same N and D = {dim}")
    if total < 2:
        raise ValueError("the (gathered) batch needs at least 2 images to have negatives")
    if not 0 <= anchor_offset <= total - batch:
        raise ValueError(f"anchor_offset {anchor_offset} does not fit {batch} anchors in {total} rows")
    if gathered_online is None:
        if total != batch:
            raise ValueError(f"target_large has {total} rows but the local batch is {batch}: pass the online "
                             "views gathered with gather_with_grad as gathered_online")
    elif len(gathered_online) != len(online_views) or any(
        g.shape != (total, dim) for g in gathered_online
    ):
        raise ValueError(f"gathered_online must hold {len(online_views)} tensors [{total}, {dim}]")

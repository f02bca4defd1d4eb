"""The distributed set-up in one place: torchrun's environment (none: a world of one), init/teardown,
collectives. NCCL on GPUs, gloo on CPU, so the same code runs 2 CPU processes in the tests and many GPUs on
a cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relicv2.jobs.config import ConfigError
from relicv2.jobs.device import resolve_device
from relicv2.jobs.ranks import RanksError, ranks_from_env
from relicv2.pretrain.loss import gather_with_grad
from relicv2.shards.checks import check_shard_set
from relicv2.shards.shardset import (
    ShardSet,
    ShardSetError,
    Spec,
    derive_missing_indexes,
    resolve_shard_set,
)


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl" on GPU, "gloo" on CPU

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes checkpoints and runs the kNN monitor."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def describe_environment(device: str = "auto", env: dict[str, str] | None = None, *,
                         option: str = "run.device") -> DistributedContext:
    """The context implied by torchrun's variables in `env` (default: os.environ) and `device` (as
    `jobs.device.resolve_device` reads it, `option` naming the setting); pure, starts nothing."""
    try:
        ranks = ranks_from_env(env)
        chosen = torch.device(resolve_device(device, option, local_rank=ranks.local_rank))
    except RanksError as error:
        raise RuntimeError(f"malformed torchrun environment: {error}") from None
    except ConfigError as error:
        raise RuntimeError(str(error)) from None
    return DistributedContext(ranks.rank, ranks.world_size, ranks.local_rank, chosen,
                              "nccl" if chosen.type == "cuda" else "gloo")


def init(device: str = "auto", *, option: str = "run.device") -> DistributedContext:
    """Describe the environment and, in a multi-process job, join the process group."""
    ctx = describe_environment(device, option=option)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if ctx.is_distributed and not dist.is_initialized():
        # torchrun provides MASTER_ADDR/MASTER_PORT, so the default env:// rendezvous works.
        kwargs: dict[str, Any] = {"device_id": ctx.device} if ctx.device.type == "cuda" else {}
        dist.init_process_group(backend=ctx.backend, rank=ctx.rank, world_size=ctx.world_size, **kwargs)
    return ctx


def teardown(ctx: DistributedContext) -> None:
    """Leave the process group (no-op for a world of one)."""
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistributedContext) -> None:
    if ctx.is_distributed:
        dist.barrier()


def open_shard_sets(ctx: DistributedContext | None, *specs: Spec, check_samples: bool = True,
                    allow_lost: bool = False, **check: Any) -> list[ShardSet]:
    """The job's one resolution of each shard set (`shards.resolve_shard_set`; with `allow_lost` the tars it
    cannot index are in `ShardSet.lost`), to be handed to everything that reads it.

    In a multi-rank job the sets' missing index files are derived first, and with `check_samples` their
    samples checked (`check`: `shards.checks.check_shard_set`'s decode options), split over the
    ranks with a barrier after each: each tar is read once by one rank instead of once by every rank, given
    an index cache every rank sees (`$RELICV2_INDEX_CACHE` on a shared filesystem)."""
    distributed = ctx is not None and ctx.is_distributed
    part = (ctx.rank, ctx.world_size) if distributed else (0, 1)
    if distributed:
        for spec in specs:
            try:  # progress with a total and ETA; bad tars and sets are reported when every rank resolves them next
                derive_missing_indexes(spec, part=part)
            except (ShardSetError, OSError):
                continue  # every rank meets the same error right after, and reports it there
        barrier(ctx)  # every index exists before any rank resolves or checks a set
    sets = [resolve_shard_set(spec, allow_lost=allow_lost) for spec in specs]
    if distributed and check_samples:
        for shard_set in sets:
            try:
                check_shard_set(shard_set, part=part, **check)
            except (ValueError, OSError):
                continue  # as above: reported, with the file and the fix, when the set is loaded
        barrier(ctx)
    return sets


def all_gather_rows(tensor: Tensor, ctx: DistributedContext) -> Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order, without gradient, when their numbers of
    rows differ (an empty one's other sizes are ignored): each padded to the largest shape, then trimmed."""
    if not ctx.is_distributed:
        return tensor
    shapes = gather_with_grad(torch.tensor([tensor.shape], device=tensor.device))
    padded = tensor.new_zeros(shapes.amax(dim=0).tolist())
    padded[tuple(slice(0, size) for size in tensor.shape)] = tensor.detach()
    parts = gather_with_grad(padded[None])
    return torch.cat([part[:rows] for part, rows in zip(parts, shapes[:, 0].tolist(), strict=True)])


def gather_tensor(tensor: Tensor, ctx: DistributedContext) -> Tensor | None:
    """Every rank's `tensor` (one shape on every rank) stacked in rank order [W, ...] on rank 0; None on the others."""
    if not ctx.is_distributed:
        return tensor[None]
    stacked = tensor.new_empty((ctx.world_size, *tensor.shape)) if ctx.is_main else None
    dist.gather(tensor.contiguous(), None if stacked is None else list(stacked.unbind()), dst=0)
    return stacked


def all_gather_object(obj: Any, ctx: DistributedContext) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (used for per-rank data and RNG states)."""
    if not ctx.is_distributed:
        return [obj]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_object(obj: Any, ctx: DistributedContext) -> list[Any] | None:
    """Every rank's picklable `obj` in rank order on rank 0; None on the other ranks."""
    if not ctx.is_distributed:
        return [obj]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def all_reduce_mean(tensor: Tensor, ctx: DistributedContext) -> Tensor:
    """Mean over ranks of `tensor` (a new tensor, no gradient)."""
    out = tensor.detach().clone()
    if ctx.is_distributed:
        dist.all_reduce(out)
    return out / ctx.world_size


def convert_sync_batchnorm(module: nn.Module, ctx: DistributedContext) -> nn.Module:
    """Replace every BatchNorm so that batch statistics are computed over the global batch: torch's
    `SyncBatchNorm` on GPU; it refuses CPU tensors, so on CPU `CrossRankBatchNorm` (same maths, gloo)."""
    if ctx.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CrossRankBatchNorm):
        out = CrossRankBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        out.load_state_dict(module.state_dict())  # the affine parameters and running statistics
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, ctx))
    return out


class CrossRankBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training-mode statistics span all ranks, for CPU (gloo) process groups, where
    `nn.SyncBatchNorm` refuses the inputs. The statistics are differentiable all-reduces, so gradients flow
    through the global mean and variance exactly as in `SyncBatchNorm`; two passes (mean, then centred
    squares) keep the variance as accurate as `F.batch_norm`'s."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1, *([1] * (x.dim() - 2))]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        # Sums over ranks: every rank's copy gathered and summed, so the backward (`gather_with_grad`'s) gives
        # each rank the sum of every rank's gradient.
        total = gather_with_grad(torch.cat([x.sum(dims), count])[None]).sum(0)
        count = total[-1]
        mean = total[:-1] / count
        centred = x - mean.view(shape)
        var = gather_with_grad((centred * centred).sum(dims)[None]).sum(0) / count
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(unbiased.detach(), momentum)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

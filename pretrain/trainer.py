"""Training state and the single, visible ReLICv2 train step, top to bottom in the order of DINO's
`train_one_epoch`: schedule -> forward of all views -> loss -> non-finite check -> backward -> clip ->
optimizer step -> EMA -> metrics. All it changes lives in one `TrainState`, saved and restored as a unit."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from relicv2.models.heads import OnlineNetwork, TargetNetwork, build_networks, ema_update
from relicv2.pretrain.config import DerivedValues, PretrainConfig
from relicv2.pretrain.distributed import (
    DistributedContext,
    all_reduce_mean,
    convert_sync_batchnorm,
)
from relicv2.pretrain.lars import LARS, parameter_groups
from relicv2.pretrain.loss import gather_with_grad, relicv2_loss
from relicv2.pretrain.schedules import ema_coefficient, learning_rate
from relicv2.pretrain.seeding import SeedPurpose, derive_seed


class NonFiniteLossError(RuntimeError):
    """The loss of step `step` (counted from 1, as logged) became NaN or infinite, with `run.on_nonfinite=stop`."""

    def __init__(self, step: int, value: float, message: str = "") -> None:
        self.step, self.value = step, value
        super().__init__(message or f"loss is {value} at step {step}")


@dataclass
class TrainState:
    """Everything a step changes. `online`/`target` are the bare networks (not DDP-wrapped)."""

    online: OnlineNetwork
    target: TargetNetwork
    optimizer: torch.optim.Optimizer
    # Draws the negatives. Re-seeded from (seed, step) at every step, identically on every rank
    # (the loss draws for the whole global batch and each rank keeps its rows), so a resumed or
    # re-sharded run draws exactly the negatives an uninterrupted single-process run draws.
    generator: torch.Generator
    step: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        """The training fields of a checkpoint (see `pretrain.checkpoint`), "rng" holding this process's
        torch CPU and CUDA RNG states. The negatives' generator is left out: every step re-seeds it."""
        cuda = torch.cuda.get_rng_state_all() if self.generator.device.type == "cuda" else []
        return {"step": self.step, "skipped_steps": self.skipped_steps, "online": self.online.state_dict(),
                "target": self.target.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "cuda": cuda}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s fields; an "rng" of None (or without CUDA states) leaves those as they are."""
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        if state.get("rng"):
            torch.set_rng_state(state["rng"]["torch"])
            if state["rng"].get("cuda") and self.generator.device.type == "cuda":
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])


@dataclass(frozen=True)
class StepSettings:
    """What one step reads: the config, the derived schedule lengths and peak lr, and the precision and
    memory layout resolved once for the device."""

    config: PretrainConfig
    derived: DerivedValues
    bf16: bool
    channels_last: bool

    @classmethod
    def from_config(cls, config: PretrainConfig, derived: DerivedValues, ctx: DistributedContext) -> StepSettings:
        on_gpu = ctx.device.type == "cuda"
        return cls(config, derived, bf16=on_gpu if config.run.bf16 is None else config.run.bf16,
                   channels_last=on_gpu if config.run.channels_last is None else config.run.channels_last)


class MultiViewForward(nn.Module):
    """Online network applied to the large views (one call) and the small views (another call). One module
    call per step, so DDP sees a single forward before each backward."""

    def __init__(self, online: OnlineNetwork) -> None:
        super().__init__()
        self.online = online

    def forward(self, large: Tensor, small: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return self.online(large), (self.online(small) if small is not None else None)


def build_state(config: PretrainConfig, ctx: DistributedContext, settings: StepSettings) -> TrainState:
    """Fresh networks, LARS optimizer and generator on `ctx.device`; identical weights on every rank."""
    torch.manual_seed(config.run.seed)  # every rank builds the same initial weights
    model = config.model
    online, target = build_networks(model.depth, model.width, hidden_dim=model.hidden_dim, out_dim=model.out_dim,
                                    zero_init_residual=model.zero_init_residual,
                                    activation_checkpointing=model.activation_checkpointing)
    if ctx.is_distributed and model.sync_batchnorm is not False:  # None: BN over the global batch (BYOL recipe)
        online, target = (convert_sync_batchnorm(network, ctx) for network in (online, target))
    memory_format = torch.channels_last if settings.channels_last else torch.preserve_format
    online, target = (network.to(ctx.device, memory_format=memory_format) for network in (online, target))
    target.train()  # the target normalises with batch statistics, as in BYOL
    optimizer = LARS(parameter_groups(online, config.optim.weight_decay), lr=0.0,  # the schedule's, each step
                     momentum=config.optim.momentum, weight_decay=config.optim.weight_decay,
                     trust_coefficient=config.optim.trust_coefficient)
    return TrainState(online, target, optimizer, generator=torch.Generator(device=ctx.device))


def wrap_networks(
    state: TrainState, ctx: DistributedContext, *, compile: bool = False, backend: str = "inductor"
) -> tuple[Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor | None]], Callable[[Tensor], Tensor]]:
    """(online forward over large+small views, target forward): DDP on the online network, optional compile."""
    online_forward: nn.Module = MultiViewForward(state.online)
    if ctx.is_distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        online_forward = DistributedDataParallel(online_forward, device_ids=device_ids)
    if compile:
        return torch.compile(online_forward, backend=backend), torch.compile(state.target, backend=backend)
    return online_forward, state.target


def train_step(state: TrainState, views: Sequence[Tensor], *,
               online_forward: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor | None]],
               target_forward: Callable[[Tensor], Tensor], settings: StepSettings,
               ctx: DistributedContext) -> dict[str, float]:
    """One ReLICv2 update on this rank's views (L large then S small, each [B, 3, H, W]). Returns the step's
    metrics averaged over ranks. Raises `NonFiniteLossError` on a NaN/inf loss unless `run.on_nonfinite=skip`,
    in which case the update is skipped and counted."""
    config, derived = settings.config, settings.derived
    step, num_large = state.step, config.views.large_views
    batch = views[0].shape[0]

    # 1. schedules: pure functions of the global step
    lr = learning_rate(step, peak_lr=derived.peak_lr, warmup_steps=derived.warmup_steps,
                       total_steps=derived.total_steps)
    ema = ema_coefficient(step, base=config.optim.ema_base, total_steps=derived.total_steps)
    for group in state.optimizer.param_groups:
        group["lr"] = lr

    # 2. forward: the large views go through each network as one batch, the small views as another
    # Without autocast the networks are fp32, so bf16 views (ViewLoader output_dtype) are widened.
    dtype = None if settings.bf16 else torch.float32
    memory_format = torch.channels_last if settings.channels_last else torch.contiguous_format
    large = torch.cat(list(views[:num_large])).to(ctx.device, dtype, non_blocking=True, memory_format=memory_format)
    small = (torch.cat(list(views[num_large:])).to(ctx.device, dtype, non_blocking=True, memory_format=memory_format)
             if len(views) > num_large else None)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
        online_large, online_small = online_forward(large, small)
        with torch.no_grad():
            target_large = target_forward(large)
    online_views = list(online_large.float().chunk(num_large))
    if online_small is not None:
        online_views += list(online_small.float().chunk(len(views) - num_large))
    target_views = list(target_large.float().chunk(num_large))

    # 3. loss over the global batch: gathered targets give the negatives, gathered online
    #    embeddings (with gradient) the reverse distribution p(b; a)
    gathered_online = None
    if ctx.is_distributed:
        target_views = list(gather_with_grad(torch.stack(target_views, dim=1).detach()).unbind(1))
        gathered_online = list(gather_with_grad(torch.stack(online_views, dim=1)).unbind(1))
    state.generator.manual_seed(derive_seed(config.run.seed, SeedPurpose.NEGATIVES, step))
    loss, parts = relicv2_loss(  # the loss section: temperature, num_negatives and the two weights
        online_views[:num_large], online_views[num_large:], target_views, **asdict(config.loss),
        generator=state.generator, anchor_offset=ctx.rank * batch, gathered_online=gathered_online,
    )

    # 4. non-finite check. This reads the loss on the host (a sync point, as in DINO). The values
    #    are averaged over ranks first: a NaN on any rank makes the mean NaN everywhere, so every
    #    rank takes the same branch and no collective is left waiting.
    reduced = all_reduce_mean(torch.stack([loss.detach(), parts["contrastive"].detach(),
                                           parts["invariance"].detach()]), ctx).tolist()
    metrics = {"loss": reduced[0], "contrastive": reduced[1], "invariance": reduced[2], "lr": lr, "ema": ema}
    state.optimizer.zero_grad(set_to_none=True)
    if not all(math.isfinite(v) for v in reduced):
        if config.run.on_nonfinite == "stop":
            raise NonFiniteLossError(step + 1, reduced[0])  # counted from 1, as in the logs
        state.step += 1
        state.skipped_steps += 1
        return {**metrics, "skipped": 1.0, "skipped_steps": float(state.skipped_steps)}

    # 5. backward, clip, step (DDP averages the gradients over ranks during backward)
    loss.backward()
    if config.optim.clip_grad_norm > 0:
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(state.online.parameters(),
                                                                    config.optim.clip_grad_norm))
    state.optimizer.step()

    # 6. EMA of the target network
    ema_update(state.target, state.online, ema)

    state.step += 1
    return {**metrics, "skipped": 0.0, "skipped_steps": float(state.skipped_steps)}

"""The pretraining job: data source, state, resume, the step loop, checkpoints, logging, kNN monitor.

`run_pretraining(config)` is what `relicv2 pretrain` calls, on every rank of a torchrun job (or
in a plain process). The update itself is `pretrain.trainer.train_step`; this module only
schedules it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from pretrain.config import ConfigError, PretrainConfig, derive, describe, per_rank_batch, to_dict
from pretrain.distributed import DistributedContext, all_gather_object, barrier, init, teardown
from pretrain.eval.knn import evaluate_knn
from pretrain.metrics_log import MetricsLogger
from pretrain.trainer import (
    NonFiniteLossError,
    StepSettings,
    TrainState,
    build_state,
    train_step,
    wrap_networks,
)
from pretrain.views.synthetic import SyntheticViews
from shards.atomic import atomic_write_bytes


@dataclass(frozen=True)
class PretrainResult:
    output_dir: Path
    step: int  # global steps done
    skipped_steps: int
    last_checkpoint: Path | None
    last_metrics: dict[str, float] = field(default_factory=dict)


def run_pretraining(
    config: PretrainConfig, *, resume: str | Path | None = None, auto_resume: bool = True
) -> PretrainResult:
    """Pretrain as `config` says; resume from `resume`, or else from the newest checkpoint in the
    output folder when `auto_resume`. Joins/leaves the torchrun process group around the run."""
    ctx = init(config.run.device)
    try:
        return _pretrain(config, ctx, resume=resume, auto_resume=auto_resume)
    finally:
        teardown(ctx)


def build_view_source(config: PretrainConfig, ctx: DistributedContext) -> Any:
    """This rank's multi-view batches: `pretrain.views.loader.ViewLoader` over shards, or generated data."""
    batch = per_rank_batch(config, ctx.world_size)
    views = config.views
    if config.data.source == "synthetic":
        return SyntheticViews(
            config.data.synthetic_images, batch, rank=ctx.rank, world_size=ctx.world_size,
            seed=config.run.seed, large_views=views.large_views, small_views=views.small_views,
            large_size=views.large_size, small_size=views.small_size,
            num_classes=config.data.synthetic_classes, device=ctx.device,
        )
    if not config.data.train_shards:
        raise ConfigError("data.train_shards is empty; set it to a shard set folder (or data.source=synthetic)")
    from pretrain.views.loader import ViewLoader  # imported here: it loads DALI

    try:
        return ViewLoader(
            config.data.train_shards, batch, device=str(ctx.device), rank=ctx.rank,
            world_size=ctx.world_size, seed=config.run.seed, **to_dict(views),
        )
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"data.train_shards={config.data.train_shards}: {error}") from None


def _epoch_layout(source: Any, world_size: int) -> tuple[int, int]:
    """(images per epoch over all ranks, steps per epoch) as the data source counts them.

    Both sources report `epoch_size` per rank and `len()` = full batches per rank and epoch.
    """
    return int(source.epoch_size) * world_size, len(source)


def _pretrain(
    config: PretrainConfig, ctx: DistributedContext, *, resume: str | Path | None, auto_resume: bool
) -> PretrainResult:
    out = Path(config.run.output_dir)
    source = build_view_source(config, ctx)
    dataset_size, steps_per_epoch = _epoch_layout(source, ctx.world_size)
    derived = derive(config, world_size=ctx.world_size, dataset_size=dataset_size, steps_per_epoch=steps_per_epoch)
    settings = StepSettings.from_config(config, derived, ctx)
    state = build_state(config, ctx, settings)

    start = Path(resume) if resume is not None else (latest_checkpoint(out) if auto_resume else None)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        text = describe(config, derived, version=_version())
        print(text, flush=True)
        atomic_write_bytes(out / "config.yaml", text.encode())
    if start is not None:
        _restore(state, source, load_checkpoint(start), ctx, start, config)
        if ctx.is_main:
            print(f"resumed from {start} at step {state.step}", flush=True)

    online_forward, target_forward = wrap_networks(state, ctx, compile=config.run.compile)
    end_step = derived.total_steps if not config.run.max_steps else min(derived.total_steps, config.run.max_steps)
    logger = (MetricsLogger(out, total_steps=end_step, initial_step=state.step, progress_bar=config.run.progress_bar)
              if ctx.is_main else None)
    last_saved = start
    metrics: dict[str, float] = {}
    window_start, window_steps = time.perf_counter(), 0
    try:
        while state.step < end_step:
            for batch in source:
                try:
                    metrics = train_step(state, batch["views"], online_forward=online_forward,
                                         target_forward=target_forward, settings=settings, ctx=ctx)
                except NonFiniteLossError as error:
                    raise NonFiniteLossError(error.step, error.value, (
                        f"loss is {error.value} at step {error.step}; last good checkpoint: "
                        f"{last_saved or 'none (no checkpoint saved yet)'}. Resume from it with a lower "
                        "optim.base_lr or with optim.clip_grad_norm set, or set run.on_nonfinite=skip"
                    )) from None
                window_steps += 1
                if logger is not None:
                    logger.advance()
                    if state.step % config.run.log_every == 0 or state.step == end_step:
                        elapsed = time.perf_counter() - window_start
                        metrics["img/s"] = config.optim.global_batch * window_steps / max(elapsed, 1e-9)
                        metrics["epoch"] = state.step / steps_per_epoch
                        logger.log(state.step, metrics)
                        window_start, window_steps = time.perf_counter(), 0
                if state.step % config.run.checkpoint_every == 0:
                    last_saved = _save(state, source, config, ctx)
                epoch, at_epoch_end = divmod(state.step, steps_per_epoch)
                if config.knn.train_shards and at_epoch_end == 0 and epoch % config.knn.every_epochs == 0:
                    _knn_monitor(state, config, ctx, logger)
                if state.step >= end_step:
                    break
        if last_saved is None or _step_of(last_saved) != state.step:
            last_saved = _save(state, source, config, ctx)
    finally:
        if logger is not None:
            logger.close()
    return PretrainResult(out, state.step, state.skipped_steps, last_saved, metrics)


def _save(state: TrainState, source: Any, config: PretrainConfig, ctx: DistributedContext) -> Path:
    """Checkpoint on rank 0 with every rank's data-pipeline and RNG state (a collective call)."""
    data_states = all_gather_object(source.state_dict(), ctx)
    rng_states = all_gather_object(_rng_state(ctx), ctx)
    path = Path(config.run.output_dir) / f"checkpoint-{state.step:09d}.pt"
    if ctx.is_main:
        path = save_checkpoint(config.run.output_dir, {
            "config": to_dict(config),
            "step": state.step,
            "skipped_steps": state.skipped_steps,
            "online": state.online.state_dict(),
            "target": state.target.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "rng": rng_states,
            "data": data_states,
        }, keep=config.run.keep_checkpoints)
    barrier(ctx)  # no rank moves on (or exits) before the file exists
    return path


def _restore(state: TrainState, source: Any, payload: dict[str, Any], ctx: DistributedContext,
             path: Path, config: PretrainConfig) -> None:
    ranks = len(payload["data"])
    if ranks != ctx.world_size:
        raise CheckpointError(
            f"{path} was written by a run with {ranks} ranks, this run has {ctx.world_size}; resume "
            f"with the same number of processes (torchrun --nproc_per_node ...), since each rank's "
            "data-pipeline position is stored separately"
        )
    try:
        state.online.load_state_dict(payload["online"])
        state.target.load_state_dict(payload["target"])
        state.optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{path} does not fit this run's networks (model {payload['config'].get('model')} in the file, "
            f"{to_dict(config.model)} here): {str(error).splitlines()[0]}"
        ) from None
    state.step = int(payload["step"])
    state.skipped_steps = int(payload.get("skipped_steps", 0))
    source.load_state_dict(payload["data"][ctx.rank])
    rng = payload["rng"][ctx.rank]
    torch.set_rng_state(rng["torch"])
    if ctx.device.type == "cuda" and rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])
    changed = _changed_keys(payload["config"], to_dict(config))
    if changed and ctx.is_main:
        print(f"note: config differs from the checkpoint's in {', '.join(changed)}; the new values apply", flush=True)


def _knn_monitor(state: TrainState, config: PretrainConfig, ctx: DistributedContext,
                 logger: MetricsLogger | None) -> None:
    """kNN accuracy of the online encoder: every rank extracts the features of 1/W of the images,
    rank 0 gathers them, classifies and logs (so the wait stays short on large labelled sets)."""
    knn = config.knn
    result = evaluate_knn(state.online.encoder, knn.train_shards, knn.val_shards, settings=knn,
                          device=ctx.device, ctx=ctx)
    if result is not None and logger is not None:
        logger.log(state.step, {"knn_top1": result.top1, "knn_skipped": float(result.skipped)})
        logger.message(f"step {state.step}: kNN top-1 {result.top1:.4f} ({result.num_train} bank, {result.num_val} val)")


def _rng_state(ctx: DistributedContext) -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if ctx.device.type == "cuda" else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _step_of(path: Path) -> int:
    stem = path.stem
    return int(stem.split("-")[-1]) if stem.startswith("checkpoint-") and stem.split("-")[-1].isdigit() else -1


def _changed_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def _version() -> str:
    try:
        return metadata.version("relicv2")
    except metadata.PackageNotFoundError:
        return "unknown"

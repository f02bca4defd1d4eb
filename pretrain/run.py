"""The pretraining job, `run_pretraining`, on every rank of a torchrun job (or in a plain process): the
settings and shard sets checked, the run folder held, then the step loop around `pretrain.trainer.train_step`
(logging, checkpoints, the kNN monitor of `pretrain.monitor`, the stop signals of `pretrain.stop`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relicv2.jobs.config import SETTINGS_FILE, to_dict
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import FolderLockedError, folder_lock
from relicv2.jobs.version import package_version
from relicv2.pretrain.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    move_run_aside,
    remove_stale_temporaries,
    save_checkpoint,
    step_of,
    write_run_config,
)
from relicv2.pretrain.config import (
    ConfigError,
    DerivedValues,
    PretrainConfig,
    derive,
    describe,
    per_rank_batch,
)
from relicv2.pretrain.distributed import (
    DistributedContext,
    all_gather_object,
    barrier,
    gather_object,
    init,
    open_shard_sets,
    teardown,
)
from relicv2.pretrain.metrics_log import MetricsLogger, Window, truncate_metrics
from relicv2.pretrain.monitor import check_monitor_sets, knn_monitor
from relicv2.pretrain.resume import data_position, restore
from relicv2.pretrain.stop import PretrainingInterrupted, StopSignals
from relicv2.pretrain.trainer import (
    NonFiniteLossError,
    StepSettings,
    TrainState,
    build_state,
    train_step,
    wrap_networks,
)
from relicv2.pretrain.views.config import mask_mismatch
from relicv2.pretrain.views.source import ViewSource
from relicv2.pretrain.views.synthetic import SyntheticViews
from relicv2.shards.outdir import output_folder
from relicv2.shards.shardset import ShardSet, ShardSetError

JOB_NAME = "relicv2 pretrain"
# Builds this rank's data source once the process group is up (it needs the rank and the device) from the
# training shard set as the run resolved it (None for generated data).
ViewsFactory = Callable[[PretrainConfig, DistributedContext, ShardSet | None], ViewSource]


class OutOfMemory(RuntimeError):
    """A step, or the views made for it, did not fit in the GPU's memory; the message says what to change."""


@dataclass(frozen=True)
class PretrainResult:
    step: int  # global steps done
    skipped_steps: int
    last_checkpoint: Path | None


def run_pretraining(
    config: PretrainConfig, *, resume: str | Path | None = None, auto_resume: bool = True, fresh: bool = False,
    views: ViewsFactory | None = None,
) -> PretrainResult:
    """Pretrain as `config` says on the data source `views(config, ctx, train_set)` builds (default:
    `build_view_source`); resume from `resume`, or else from the newest checkpoint in the output folder when
    `auto_resume`. `fresh`: move an earlier run in the folder aside and start anew. Joins/leaves the torchrun
    process group around the run; rank 0 holds the folder's lock."""
    check_before_starting(config, resume)
    ctx = init(config.run.device)
    try:
        sets = open_run_shard_sets(config, ctx)
        with _run_folder(config, ctx, fresh=fresh), StopSignals() as stop:
            return _pretrain(config, ctx, views or build_view_source, sets, resume=resume,
                             auto_resume=auto_resume and not fresh, stop=stop)
    finally:
        teardown(ctx)


def check_before_starting(config: PretrainConfig, resume: str | Path | None) -> None:
    """What the settings alone say the run lacks, checked before anything is read: a refused run costs
    seconds, not a night (the shard sets are checked next, by `open_run_shard_sets`)."""
    resolve_device(config.run.device, "run.device")  # ConfigError: a device this machine lacks
    out = Path(config.run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir {out} is a file; choose a folder for the run")
    if config.data.source == "shards" and not config.data.train_shards:
        raise ConfigError("data.train_shards is empty; set it to a shard set folder (or data.source=synthetic)")
    if config.knn.train_shards and config.knn.crop_size != config.views.large_size:
        print(f"warning: knn.crop_size={config.knn.crop_size} but the encoder trains on views.large_size="
              f"{config.views.large_size} px views: the monitor scores it at a size it never sees; set "
              f"knn.crop_size={config.views.large_size} for the figure of the model being trained", flush=True)
    if resume is not None and not Path(resume).is_file():
        raise ConfigError(f"--resume {resume} does not exist or is not a file; pass a checkpoint-*.pt file")


def open_run_shard_sets(config: PretrainConfig, ctx: DistributedContext) -> dict[str, ShardSet]:
    """The run's shard sets by setting (`data.train_shards`, `knn.train_shards`, `knn.val_shards`), each
    resolved once (`open_shard_sets`) and checked before any work: the monitor's sets must be labelled, number
    their classes alike, and its queries be neither in its bank (refused) nor trained on (a warning). The kNN
    sets allow lost tars: the monitor never stops a training, it reads what remains and logs the loss."""
    specs = {"knn.train_shards": config.knn.train_shards, "knn.val_shards": config.knn.val_shards,
             "data.train_shards": config.data.train_shards if config.data.source == "shards" else ""}
    sets: dict[str, ShardSet] = {}
    for key, spec in specs.items():
        if spec:
            try:
                sets[key] = open_shard_sets(ctx, spec, check_samples=key.startswith("data."),
                                            allow_lost=key.startswith("knn."))[0]
            except ShardSetError as error:
                raise ConfigError(f"{key}={spec}: {error}") from None
    if "knn.train_shards" in sets:  # KnnConfig takes both sets or neither
        check_monitor_sets(sets["knn.train_shards"], sets["knn.val_shards"], sets.get("data.train_shards"))
    return sets


def check_masking(config: PretrainConfig, source: ViewSource, ctx: DistributedContext) -> None:
    """Refuse a run whose masking setting and training shards disagree (before any step), unless
    views.allow_mask_mismatch; the shard set says whether it carries masks once it is resolved."""
    has_masks = getattr(source, "has_masks", None)  # generated data is never masked
    problem = None if has_masks is None else mask_mismatch(config.views, has_masks)
    if problem is None:
        return
    text = f"data.train_shards={config.data.train_shards} {problem}"
    if not config.views.allow_mask_mismatch:
        raise ConfigError(f"{text} (or set views.allow_mask_mismatch=true to train as configured)")
    if ctx.is_main:
        print(f"warning: {text}; training as configured (views.allow_mask_mismatch=true)", flush=True)


@contextlib.contextmanager
def _run_folder(config: PretrainConfig, ctx: DistributedContext, *, fresh: bool) -> Iterator[None]:
    """Hold the run folder for the life of the run (rank 0 takes the lock) and tidy it; the lock outcome is
    shared with every rank, so a refused rank 0 never leaves the others waiting."""
    out = Path(config.run.output_dir)
    error = None
    with contextlib.ExitStack() as stack:
        if ctx.is_main:
            try:
                stack.enter_context(output_folder(out))  # a run refused at start leaves no empty folder
                stack.enter_context(folder_lock(out, JOB_NAME))
                removed = remove_stale_temporaries(out)  # under the lock: what killed runs left half-written
                if removed:
                    print(f"removed {removed} temporary file(s) left by an interrupted run in {out}", flush=True)
                aside = move_run_aside(out) if fresh else None
                if aside is not None:
                    print(f"--fresh: moved the earlier run's checkpoints and logs to {aside}", flush=True)
            except FolderLockedError as locked:
                error = str(locked)
            except OSError as failed:
                error = f"cannot use run.output_dir {out}: {failed.strerror or failed}"
        error = all_gather_object(error, ctx)[0]
        if error is not None:
            raise ConfigError(error)
        yield


def build_view_source(config: PretrainConfig, ctx: DistributedContext, shards: ShardSet | None) -> ViewSource:
    """This rank's multi-view batches, built once per run (iterating it again starts the next epoch): a
    `ViewLoader` over `shards` (the training set as `open_run_shard_sets` resolved it), or generated data."""
    batch = per_rank_batch(config, ctx.world_size)
    views = config.views
    if config.data.source == "synthetic":
        return SyntheticViews(
            config.data.synthetic_images, batch, rank=ctx.rank, world_size=ctx.world_size,
            seed=config.run.seed, large_views=views.large_views, small_views=views.small_views,
            large_size=views.large_size, small_size=views.small_size,
            num_classes=config.data.synthetic_classes, device=ctx.device,
        )
    from relicv2.pretrain.views.loader import ViewLoader  # imported here: it loads DALI

    try:
        return ViewLoader(shards, batch, views, device=str(ctx.device), rank=ctx.rank,
                          world_size=ctx.world_size, seed=config.run.seed)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"data.train_shards={config.data.train_shards}: {error}") from None


def _pretrain(config: PretrainConfig, ctx: DistributedContext, views: ViewsFactory, sets: dict[str, ShardSet], *,
              resume: str | Path | None, auto_resume: bool, stop: StopSignals) -> PretrainResult:
    out = Path(config.run.output_dir)
    own = latest_checkpoint(out)
    if resume is not None and own is not None and Path(resume).resolve().parent != out.resolve():
        # Its steps would be written beside another run's checkpoints, and a later rerun would continue
        # whichever of the two lines has the newest step.
        raise CheckpointError(f"--resume {resume} is not a checkpoint of {out}, which holds another run (up to "
                              f"{own.name}); resume into another --output folder, or move that run out of {out} first")
    source = views(config, ctx, sets.get("data.train_shards"))  # the epoch as the source counts it: its share of images, its full batches
    check_masking(config, source, ctx)  # every rank reads the same set: all refuse alike
    derived = derive(config, world_size=ctx.world_size, dataset_size=int(source.epoch_size) * ctx.world_size,
                     steps_per_epoch=len(source))
    settings = StepSettings.from_config(config, derived, ctx)
    state = build_state(config, ctx, settings)
    start = Path(resume) if resume is not None else (own if auto_resume else None)
    if start is not None:  # before config.yaml is written: a refused resume leaves the folder as it was
        notes = restore(state, source, load_checkpoint(start), ctx, start, config,
                        steps_per_epoch=derived.steps_per_epoch)
        if ctx.is_main:
            print("\n".join([*notes, f"resumed from {start} at step {state.step}"]), flush=True)
    if ctx.is_main:
        text = describe(config, derived, version=package_version())
        print(text, flush=True)
        print(f"pretrain: {ctx.world_size} rank(s), each on {ctx.device.type}", flush=True)
        if start is not None and state.step >= final_step(config, derived):
            print(f"the run is finished at step {state.step}: nothing to train, {out / SETTINGS_FILE} kept as it was "
                  "(raise run.max_steps or optim.epochs to train on)", flush=True)
        else:
            kept = write_run_config(out, text, resumed_at=state.step if start is not None else None)
            if kept is not None:
                print(f"the settings changed: the config that trained steps 1-{state.step} is kept as {kept.name}",
                      flush=True)
        dropped = truncate_metrics(out, state.step)
        if dropped:
            print(f"metrics.jsonl: dropped {dropped} record(s) logged after step {state.step} by the interrupted run")
    barrier(ctx)
    knn = (sets["knn.train_shards"], sets["knn.val_shards"]) if "knn.train_shards" in sets else None
    return _train(config, ctx, state, source, settings, derived, knn, stop=stop, last_saved=start)


def final_step(config: PretrainConfig, derived: DerivedValues) -> int:
    """The step the run ends at: the schedule's last, or `run.max_steps` when that comes first."""
    return derived.total_steps if not config.run.max_steps else min(derived.total_steps, config.run.max_steps)


def _train(config: PretrainConfig, ctx: DistributedContext, state: TrainState, source: ViewSource,
           settings: StepSettings, derived: DerivedValues, knn: tuple[ShardSet, ShardSet] | None, *,
           stop: StopSignals, last_saved: Path | None) -> PretrainResult:
    """The step loop: one train step per batch, logging, checkpoints, the kNN monitor, stop signals."""
    compile_networks = ctx.device.type == "cuda" if config.run.compile is None else config.run.compile
    online_forward, target_forward = wrap_networks(state, ctx, compile=compile_networks,
                                                   backend=config.run.compile_backend)
    steps_per_epoch = derived.steps_per_epoch
    end_step = final_step(config, derived)
    logger = (MetricsLogger(config.run.output_dir, total_steps=end_step, initial_step=state.step,
                            progress_bar=config.run.progress_bar) if ctx.is_main else None)
    window = Window()
    first_steps: list[float] = []
    signal_name = None
    try:
        while state.step < end_step and signal_name is None:
            for batch in window.timed(_made(source)):
                step_start = time.perf_counter()
                metrics = _step(state, batch, online_forward, target_forward, settings, ctx, last_saved)
                if compile_networks and len(first_steps) < 2:
                    first_steps.append(time.perf_counter() - step_start)
                    if len(first_steps) == 2 and logger is not None:
                        logger.message(f"torch.compile: one-time cost ~{first_steps[0] - first_steps[1]:.1f} s "
                                       f"(first step {first_steps[0]:.1f} s, then {first_steps[1]:.2f} s)")
                window.steps += 1
                if logger is not None:
                    logger.advance()
                    if state.step % config.run.log_every == 0 or state.step == end_step:
                        metrics.update(window.take(config.optim.global_batch))
                        metrics["epoch"] = state.step / steps_per_epoch
                        logger.log(state.step, metrics)
                if state.step % config.run.checkpoint_every == 0:
                    last_saved = _save(state, source, config, ctx, steps_per_epoch)
                epoch, at_epoch_end = divmod(state.step, steps_per_epoch)
                if knn is not None and at_epoch_end == 0 and epoch % config.knn.every_epochs == 0:
                    knn_monitor(state, config, ctx, logger, *knn)
                signal_name = stop.agreed(ctx)
                if signal_name is not None or state.step >= end_step:
                    break
        if last_saved is None or step_of(last_saved) != state.step:
            last_saved = _save(state, source, config, ctx, steps_per_epoch)
    finally:
        if logger is not None:
            logger.close()
    if signal_name is not None:
        raise PretrainingInterrupted(signal_name, state.step, last_saved)
    return PretrainResult(state.step, state.skipped_steps, last_saved)


def _step(state: TrainState, batch: dict[str, Any], online_forward: Any, target_forward: Any,
          settings: StepSettings, ctx: DistributedContext, last_saved: Path | None) -> dict[str, float]:
    """`train_step` with its two expected failures turned into errors that say what to do."""
    try:
        return train_step(state, batch["views"], online_forward=online_forward, target_forward=target_forward,
                          settings=settings, ctx=ctx)
    except NonFiniteLossError as error:
        raise NonFiniteLossError(error.step, error.value, (
            f"loss is {error.value} at step {error.step}; last good checkpoint: "
            f"{last_saved or 'none (no checkpoint saved yet)'}. Resume from it with a lower "
            "optim.base_lr or with optim.clip_grad_norm set, or set run.on_nonfinite=skip"
        )) from None
    except torch.OutOfMemoryError:
        batch_size = batch["views"][0].shape[0]
        raise OutOfMemory(
            f"out of GPU memory in step {state.step + 1} with {batch_size} images per rank; lower the "
            "per-rank batch (optim.global_batch, or more GPUs), set model.activation_checkpointing=true, "
            f"and keep run.bf16 on (now {settings.bf16}); views.ready_batches=0 and views.output_dtype=bfloat16 "
            "free the memory of the batches the view loader keeps ready"
        ) from None


def _made(source: ViewSource) -> Iterator[dict[str, Any]]:
    """`source`'s batches; a GPU out of memory while making them is said as what to change."""
    try:
        yield from source
    except torch.OutOfMemoryError:  # raised where the views are made (the loader's thread on a GPU)
        raise OutOfMemory(
            "out of GPU memory while making the next batch of views; set views.ready_batches=0 (batches "
            "made on demand) or views.output_dtype=bfloat16, or lower the per-rank batch "
            "(optim.global_batch, or more GPUs)"
        ) from None


def _save(state: TrainState, source: ViewSource, config: PretrainConfig, ctx: DistributedContext,
          steps_per_epoch: int) -> Path:
    """Checkpoint on rank 0 with every rank's data-pipeline and RNG state (a collective call)."""
    training = state.state_dict()
    states = gather_object((source.state_dict(), training["rng"]), ctx)  # on rank 0 only: it alone writes
    path = checkpoint_path(config.run.output_dir, state.step)
    if states is not None:
        data_states, rng_states = ([data for data, _ in states], [rng for _, rng in states])
        try:
            payload = {"config": to_dict(config), **training, "rng": rng_states, "data": data_states,
                       "data_position": data_position(state.step, steps_per_epoch, config.optim.global_batch)}
            path = save_checkpoint(config.run.output_dir, payload, keep=config.run.keep_checkpoints)
        except (OSError, RuntimeError) as error:  # RuntimeError: torch's own failures
            cause = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
            raise ConfigError(f"cannot write checkpoint {path}: {cause}; free space or choose another "
                              "run.output_dir, then rerun to resume") from None
    barrier(ctx)  # no rank moves on (or exits) before the file exists
    return path

"""Restoring a run from a checkpoint: what must match, what may change, and the data position.

A checkpoint stores every rank's data-pipeline state and the global data position `{"epoch", "samples"}`
(samples consumed in the epoch's global order, whatever the number of ranks). With the same world size and
global batch each rank gets its own `state_dict()` back (exact); otherwise every source is given the global
position (`pretrain.views.source.global_position_state`), re-split over the new ranks; with another global
batch, progress is kept in images seen (see `restore`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relicv2.jobs.config import removed_settings, to_dict
from relicv2.pretrain.checkpoint import CheckpointError
from relicv2.pretrain.config import PretrainConfig
from relicv2.pretrain.distributed import DistributedContext
from relicv2.pretrain.trainer import TrainState
from relicv2.pretrain.views.source import StateVersionError, ViewSource, global_position_state

# Settings a run cannot change on resume: the data order, the augmentations and the data set
# itself depend on them, so the resumed run would silently train on another stream.
FIXED_ON_RESUME = ("run.seed", "data.source", "data.train_shards", "data.synthetic_images",
                   "data.synthetic_classes", "views.backend")
PATH_SETTINGS = ("data.train_shards",)  # compared as the places they name

DALI_RESPLIT = ("; DALI's reader draws the rest of this epoch from a new order over the new shares, so in this "
                "epoch some images are seen twice and others not at all (the reference backend continues exactly)")


def data_position(step: int, steps_per_epoch: int, global_batch: int) -> dict[str, int]:
    """Where a run stands in its data at `step`: epoch and samples consumed in that epoch's global order."""
    epoch, batches = divmod(step, steps_per_epoch)
    return {"epoch": epoch, "samples": batches * global_batch}


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal settings; paths (shard set specs) are equal when they name the same place from here,
    so `sh/train`, `sh/train/` and `/abs/sh/train` do not refuse a resume."""
    if key in PATH_SETTINGS and isinstance(old, str) and isinstance(new, str) and old and new:
        return os.path.abspath(old) == os.path.abspath(new)  # abspath also normalises `//`, `./`, a final `/`
    return old == new


def check_compatible(saved: dict[str, Any], config: PretrainConfig, path: Path) -> None:
    """Refuse a resume whose fixed settings differ, naming the first setting and both values."""
    current = to_dict(config)
    for key in FIXED_ON_RESUME:
        old, new = _lookup(saved, key), _lookup(current, key)
        if old is not None and not _same(key, old, new):
            raise CheckpointError(
                f"cannot resume from {path}: {key} is {old!r} there and {new!r} here, and the data stream "
                f"depends on it; resume with --set {key}={old}, or start a new run with --fresh"
            )


def restore(state: TrainState, source: ViewSource, payload: dict[str, Any], ctx: DistributedContext,
            path: Path, config: PretrainConfig, *, steps_per_epoch: int) -> list[str]:
    """Load networks, optimizer, step, RNG and data position from `payload`; returns notes to print."""
    check_compatible(payload["config"], config, path)
    notes = []
    global_batch = config.optim.global_batch
    saved_batch = int(_lookup(payload["config"], "optim.global_batch") or global_batch)
    saved_ranks = len(payload["data"])
    step = int(payload["step"])
    gone = removed_settings(PretrainConfig, payload["config"])  # its data stream cannot be replayed exactly
    if saved_batch != global_batch:
        images_seen = step * saved_batch
        step = images_seen // global_batch
        notes.append(
            f"note: optim.global_batch changed from {saved_batch} to {global_batch}. Kept: the online and "
            f"target networks, the optimizer's momentum, and the images seen ({images_seen}), so the run "
            f"continues at step {step} of the schedule for the new batch (lr and EMA follow it); the data "
            "position restarts at that step's place in the epoch order, so up to one batch of images is "
            "seen again or skipped"
        )
    position = data_position(step, steps_per_epoch, global_batch)
    same_place = (f"the run continues at the same data position (epoch {position['epoch']}, "
                  f"{position['samples']} samples in) with this version's data stream")
    if saved_batch == global_batch and saved_ranks == ctx.world_size and not gone:
        try:
            source.load_state_dict(payload["data"][ctx.rank])  # exact: the rank's own reader state
        except StateVersionError as error:  # written by another relicv2: continue at the same place
            _load_global_position(source, position, global_batch, ctx, path, saved_ranks)
            notes.append(f"note: {error}; {same_place}")
        except (KeyError, ValueError, TypeError) as error:
            raise CheckpointError(
                f"cannot resume from {path}: its data position does not fit this data source ({error}); "
                "resume on the same shard set, or start a new run with --fresh"
            ) from None
    else:
        _load_global_position(source, position, global_batch, ctx, path, saved_ranks)
        if gone:
            settings = ", ".join(f"{key}={value!r}" for key, (value, _) in gone.items())
            reasons = "; ".join(removed.why for _, removed in gone.values())
            notes.append(f"note: {path} was trained with {settings}, removed since ({reasons}); {same_place}")
        if saved_ranks != ctx.world_size:
            notes.append(f"note: {path} was written by {saved_ranks} rank(s), this run has {ctx.world_size}; "
                         f"the data position (epoch {position['epoch']}, {position['samples']} samples in) "
                         "is split over the new ranks"
                         + (DALI_RESPLIT if config.data.source == "shards" and config.views.backend == "dali" else ""))
    rngs = payload["rng"]
    rng = rngs[ctx.rank if ctx.rank < len(rngs) else 0] if rngs else None
    if rng and saved_ranks != ctx.world_size:  # the CUDA states were another split's devices': left as they are
        rng = {**rng, "cuda": []}
    try:  # last: loading the data position must not draw from the restored RNG
        state.load_state_dict({**payload, "step": step, "rng": rng})
    except (RuntimeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{path} does not fit this run's networks (model {payload['config'].get('model')} in the file, "
            f"{to_dict(config.model)} here): {str(error).strip().splitlines()[0]}"
        ) from None
    changed = changed_keys(payload["config"], to_dict(config))
    if changed:
        notes.append(f"note: config differs from the checkpoint's in {', '.join(changed)}; the new values apply")
    return notes


def _load_global_position(source: ViewSource, position: dict[str, int], global_batch: int,
                          ctx: DistributedContext, path: Path, saved_ranks: int) -> None:
    try:
        source.load_state_dict(global_position_state(**position, global_batch=global_batch))
    except (KeyError, ValueError, TypeError) as error:
        raise CheckpointError(
            f"cannot resume from {path} with {ctx.world_size} rank(s) (it was written by {saved_ranks}) "
            f"or another global batch: this data source cannot take the position ({error}); resume with "
            f"{saved_ranks} rank(s) and the same optim.global_batch"
        ) from None


def changed_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the settings of `new` whose values differ in `old` (a key `new` lacks was removed
    since: no setting of this run)."""
    changed = []
    for key in sorted(new):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed

"""Pretraining checkpoints: atomic files, keep-last-K rotation, strict loading.

One file per save, `checkpoint-{step:09d}.pt` in the run's output folder, in the format that
`models.checkpoint_file.CHECKPOINT` declares (read with `weights_only=True`: nothing in it can run code):
the resolved config as a nested dict, `pretrain.trainer.TrainState.state_dict()`'s fields ("rng" from
every rank), every rank's view-loader state ("data") and the global "data_position" (`pretrain.resume`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from relicv2.jobs.atomic import atomic_write_bytes, remove_stale_temps
from relicv2.jobs.config import SETTINGS_FILE, build
from relicv2.models.checkpoint_file import (  # noqa: F401 (the reading side lives in a leaf both stages use)
    CHECKPOINT,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    step_of,
)
from relicv2.models.encoder_file import encoder_file_in, load_encoder_file
from relicv2.models.resnet import ResNet, resnet
from relicv2.models.torchfile import load_failure
from relicv2.pretrain.config import ConfigError, PretrainConfig
from relicv2.pretrain.metrics_log import METRICS_NAME

# The files a run writes in its output folder besides its checkpoints (moved aside together by --fresh).
RUN_FILES = (SETTINGS_FILE, METRICS_NAME, "tensorboard")
# The config a run had up to a step, kept when a resume changed it (`write_run_config`).
EARLIER_CONFIG = "config-to-step-{:09d}.yaml"


def save_checkpoint(output_dir: str | Path, payload: dict[str, Any], *, keep: int) -> Path:
    """Write `payload` (see module docstring) atomically as this step's file; keep the newest `keep` files.
    Rotation only removes checkpoints of steps before this one: files of a later step can only be another
    run's (`--fresh` moves those aside first), and are never deleted here."""
    step = int(payload.get("step", 0))  # a payload without one is refused by the save
    path = CHECKPOINT.save(checkpoint_path(output_dir, step), payload)
    older = [p for p in list_checkpoints(output_dir) if (step_of(p) or 0) <= step]
    for old in older[:-keep]:
        old.unlink(missing_ok=True)
    return path


def remove_stale_temporaries(output_dir: str | Path) -> int:
    """Delete the temporary files a killed run left in its folder (partial checkpoints, config, metrics); the
    count. Call it only while holding the folder's lock: then no live writer owns them."""
    return remove_stale_temps(Path(output_dir), lambda final: step_of(final) is not None or final in RUN_FILES)


def write_run_config(folder: Path, text: str, *, resumed_at: int | None) -> Path | None:
    """Write the run's `config.yaml`. On a resume (`resumed_at`: the checkpoint's step) with a config
    whose text differs, the one that trained the steps so far is first kept as
    config-to-step-N.yaml (the first one for that step: a resume that trained nothing since does not
    replace it), so the folder always says which settings made which steps. Returns that file, if kept."""
    path = Path(folder) / SETTINGS_FILE
    kept = None
    if resumed_at is not None and path.is_file() and path.read_text(encoding="utf-8") != text:
        earlier = Path(folder) / EARLIER_CONFIG.format(resumed_at)
        if not earlier.exists():
            os.replace(path, earlier)
            kept = earlier
    atomic_write_bytes(path, text.encode("utf-8"))
    return kept


def move_run_aside(output_dir: str | Path) -> Path | None:
    """Move an earlier run's checkpoints and logs into `<output_dir>/previous-<time>/` (for `--fresh`); the
    new folder, or None when there was nothing to move."""
    folder = Path(output_dir)
    found = [*list_checkpoints(folder), *(folder / name for name in RUN_FILES if (folder / name).exists()),
             *sorted(folder.glob(EARLIER_CONFIG.replace("{:09d}", "[0-9]" * 9)))]
    if not found:
        return None
    stamp = time.strftime("previous-%Y%m%d-%H%M%S")
    aside, suffix = folder / stamp, 0
    while aside.exists():
        suffix += 1
        aside = folder / f"{stamp}-{suffix}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside


def encoder_from_checkpoint(path: str | Path, *, network: str = "online") -> ResNet:
    """The ResNet encoder ("online" or "target" network), on CPU, of a checkpoint file or a run's output
    folder (its newest checkpoint); any file that does not hold such an encoder raises one `CheckpointError`."""
    if network not in ("online", "target"):
        raise ValueError(f"network must be 'online' or 'target', got {network!r}")
    exported = encoder_file_in(path)
    if exported is not None:  # an exported encoder (or hub folder) is accepted wherever a checkpoint is
        return load_encoder_file(exported, network=network)
    path = resolve_checkpoint(path)
    return encoder_from_payload(load_checkpoint(path), path, network=network)


def checkpoint_config(payload: dict[str, Any], path: Path) -> PretrainConfig:
    """The run config embedded in a checkpoint read by `load_checkpoint` from `path`; CheckpointError if damaged."""
    try:
        return build(PretrainConfig, payload["config"], source=f"the config embedded in {path}", saved=True)
    except ConfigError as error:
        raise CheckpointError(f"{error}; the checkpoint is damaged or from another relicv2 version") from None


def encoder_from_payload(payload: dict[str, Any], path: Path, *, network: str = "online") -> ResNet:
    """The encoder of a checkpoint read by `load_checkpoint` from `path` (named in errors)."""
    config = checkpoint_config(payload, path)
    encoder = resnet(config.model.depth, config.model.width)
    try:
        encoder.load_state_dict({name.removeprefix("encoder."): value for name, value in payload[network].items()
                                 if name.startswith("encoder.")})
    except RuntimeError as error:
        problem = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), load_failure(error))
        raise CheckpointError(
            f"{path}: the {network} encoder's weights do not fit the ResNet-{config.model.depth} "
            f"(width {config.model.width}) its config describes ({problem[:300]}); the file is damaged or hand-made"
        ) from None
    return encoder


def random_encoder(depth: int, width: int = 1, *, seed: int = 0) -> ResNet:
    """A randomly initialised encoder (torchvision's initialisation): the baseline kNN score."""
    torch.manual_seed(seed)
    return resnet(depth, width)

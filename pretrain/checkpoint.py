"""Pretraining checkpoints: atomic files, keep-last-K rotation, strict loading.

One file per save, `checkpoint-{step:09d}.pt` in the run's output folder, written to a hidden
temporary name, fsynced and renamed (a killed job never leaves a half-written checkpoint under a
final name). Contents (plain containers of tensors and builtins, so `torch.load(weights_only=True)`
reads them and nothing in the file can run code):

    format       "relicv2-pretrain-checkpoint"      version  1
    config       the resolved config as a nested dict
    (step to rng: `pretrain.trainer.TrainState.state_dict()`, "rng" gathered from every rank)
    step         global steps done                  skipped_steps  non-finite steps skipped
    online       online network state dict          target   target network state dict
    optimizer    LARS state dict
    rng          per rank: {"torch": CPU RNG state, "cuda": [CUDA RNG states]}
    data         per rank: the view loader's state_dict (DALI reader checkpoint or generator position)
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from jobs.atomic import atomic_output, atomic_write_bytes, remove_stale_temps
from pretrain.config import ConfigError, PretrainConfig, from_dict
from pretrain.model.encoder_file import (
    is_encoder_file,
    is_state_dict,
    load_encoder_file,
    sidecar_path,
)
from pretrain.model.resnet import ResNet, resnet
from pretrain.untrusted import TORCH_LOAD_ERRORS, load_failure

FORMAT = "relicv2-pretrain-checkpoint"
VERSION = 1
REQUIRED_KEYS = ("config", "step", "online", "target", "optimizer", "rng", "data")
_NAME = re.compile(r"^checkpoint-(\d{9})\.pt$")
CONFIG_NAME = "config.yaml"  # the resolved config of the run in its folder
# The files a run writes in its output folder besides its checkpoints (moved aside together by --fresh).
RUN_FILES = (CONFIG_NAME, "metrics.jsonl", "tensorboard")
# The config a run had up to a step, kept when a resume changed it (`write_run_config`).
_EARLIER_CONFIG = re.compile(r"^config-to-step-(\d{9})\.yaml$")
# What to give instead of a file that is not a checkpoint.
_WHAT_TO_PASS = ("a run folder, a checkpoint-*.pt file written by `relicv2 pretrain` or (to eval) an encoder "
                 "exported by `relicv2 export`")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (missing, corrupt, foreign, or from another version)."""


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """The file of the checkpoint after `step` global steps (the one owner of the naming scheme)."""
    return Path(output_dir) / f"checkpoint-{step:09d}.pt"


def step_of(path: str | Path) -> int | None:
    """The step in a checkpoint file name, or None when the name is not a checkpoint's."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """This run's checkpoint files, oldest step first (temporary files are ignored)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in `output_dir`, or None (for automatic resume)."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(output_dir: str | Path, payload: dict[str, Any], *, keep: int) -> Path:
    """Write `payload` (see module docstring) atomically as this step's file; keep the newest `keep` files.

    Rotation only removes checkpoints of steps before this one: files of a later step can only be
    another run's (`--fresh` moves those aside first), and are never deleted here.
    """
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    path = checkpoint_path(output_dir, int(payload["step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        torch.save({"format": FORMAT, "version": VERSION, **payload}, tmp)
    older = [p for p in list_checkpoints(output_dir) if (step_of(p) or 0) <= int(payload["step"])]
    for old in older[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; any unusable file raises one `CheckpointError`.

    Uses `weights_only=True`: the file may come from someone else, and a pickle could run code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except TORCH_LOAD_ERRORS as error:
        first_line = load_failure(error)
        if step_of(path) is not None:  # a run's own checkpoint, damaged (a killed copy, a full disk)
            raise CheckpointError(
                f"{path} is not a readable relicv2 pretraining checkpoint ({first_line}); it may be truncated: "
                "delete it (a run then resumes from the previous checkpoint) or pass another file"
            ) from None
        raise CheckpointError(
            f"{path} is not a readable relicv2 pretraining checkpoint ({first_line}); pass {_WHAT_TO_PASS}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        if is_state_dict(payload) and "conv1.weight" in payload:  # an exported ResNet without its sidecar
            raise CheckpointError(
                f"{path} is not a relicv2 pretraining checkpoint: it holds a plain encoder state dict, like an "
                f"exported encoder whose sidecar {sidecar_path(path).name} is missing (`relicv2 export` writes "
                "it beside the .pt): put the sidecar back beside it, or pass a run folder or a checkpoint-*.pt"
            )
        held = sorted(payload)[:5] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a relicv2 pretraining checkpoint (it holds {held}); pass {_WHAT_TO_PASS}")
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {payload.get('version')}, this relicv2 reads version "
            f"{VERSION}; use the relicv2 release that wrote it"
        )
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; the file is incomplete, delete it and resume from an older one")
    _check_types(path, payload)
    return payload


def _check_types(path: Path, payload: dict[str, Any]) -> None:
    """Hand-made or damaged files: every field has the type the loaders rely on, checked up front."""
    expected = {"config": dict, "step": int, "online": dict, "target": dict, "optimizer": dict,
                "rng": list, "data": list}
    for key, kind in expected.items():
        value = payload[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(
                f"{path}: field {key!r} is a {type(value).__name__}, a relicv2 checkpoint holds a "
                f"{kind.__name__} there; the file is damaged or hand-made, use a checkpoint written by "
                "`relicv2 pretrain`"
            )
    if payload["step"] < 0:
        raise CheckpointError(f"{path}: field 'step' is {payload['step']}; a step count is never negative")
    for network in ("online", "target"):
        bad = [name for name, value in payload[network].items() if not isinstance(value, torch.Tensor)]
        if bad:
            raise CheckpointError(f"{path}: {network}[{bad[0]!r}] is not a tensor; the file is damaged or hand-made")


def remove_stale_temporaries(output_dir: str | Path) -> int:
    """Delete the temporary files a killed run left in its folder (partial checkpoints, config, metrics).

    Call it only while holding the folder's lock: then no live writer owns them. Returns the count.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return 0
    return remove_stale_temps(folder, lambda final: bool(_NAME.match(final)) or final in RUN_FILES)


def earlier_config_path(folder: Path, step: int) -> Path:
    """Where the config that trained a run's steps up to `step` is kept after a resume changed it."""
    return Path(folder) / f"config-to-step-{step:09d}.yaml"


def write_run_config(folder: Path, text: str, *, resumed_at: int | None) -> Path | None:
    """Write the run's `config.yaml`. On a resume (`resumed_at`: the checkpoint's step) with a config
    whose text differs, the one that trained the steps so far is first kept as
    config-to-step-N.yaml (the first one for that step: a resume that trained nothing since does not
    replace it), so the folder always says which settings made which steps. Returns that file, if kept."""
    path = Path(folder) / CONFIG_NAME
    kept = None
    if resumed_at is not None and path.is_file() and path.read_text(encoding="utf-8") != text:
        earlier = earlier_config_path(folder, resumed_at)
        if not earlier.exists():
            os.replace(path, earlier)
            kept = earlier
    atomic_write_bytes(path, text.encode("utf-8"))
    return kept


def move_run_aside(output_dir: str | Path) -> Path | None:
    """Move an earlier run's checkpoints and logs into `<output_dir>/previous-<time>/` (for `--fresh`).

    Returns the new folder, or None when there was nothing to move.
    """
    folder = Path(output_dir)
    found = [*list_checkpoints(folder), *(folder / name for name in RUN_FILES if (folder / name).exists()),
             *sorted(p for p in folder.glob("config-to-step-*.yaml") if _EARLIER_CONFIG.match(p.name))]
    if not found:
        return None
    aside = folder / time.strftime("previous-%Y%m%d-%H%M%S")
    suffix = 0
    while aside.exists():
        suffix += 1
        aside = folder / f"{time.strftime('previous-%Y%m%d-%H%M%S')}-{suffix}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself, or the newest checkpoint-*.pt when `path` is a run's output folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a checkpoint-*.pt file or a pretraining output folder")
    if not path.is_dir():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(f"no checkpoint-*.pt in {path}; pass a checkpoint file or a pretraining output folder")
    return newest


def encoder_from_checkpoint(path: str | Path, *, network: str = "online") -> ResNet:
    """The ResNet encoder of a pretraining checkpoint ("online" or "target" network), on CPU.

    `path` is a checkpoint file or a run's output folder (its newest checkpoint is used). Any file
    that does not hold such an encoder raises one `CheckpointError`.
    """
    if network not in ("online", "target"):
        raise ValueError(f"network must be 'online' or 'target', got {network!r}")
    if is_encoder_file(path):  # an exported encoder is accepted wherever a checkpoint is
        return load_encoder_file(path, network=network)
    path = resolve_checkpoint(path)
    return encoder_from_payload(load_checkpoint(path), path, network=network)


def checkpoint_config(payload: dict[str, Any], path: Path) -> PretrainConfig:
    """The run config embedded in a checkpoint read by `load_checkpoint` from `path`; CheckpointError if damaged."""
    try:
        return from_dict(payload["config"], source=f"the config embedded in {path}")
    except ConfigError as error:
        raise CheckpointError(f"{error}; the checkpoint is damaged or from another relicv2 version") from None


def encoder_from_payload(payload: dict[str, Any], path: Path, *, network: str = "online") -> ResNet:
    """The encoder of a checkpoint read by `load_checkpoint` from `path` (named in errors)."""
    config = checkpoint_config(payload, path)
    encoder = resnet(config.model.depth, config.model.width)
    prefix = "encoder."
    state = {name[len(prefix):]: value for name, value in payload[network].items() if name.startswith(prefix)}
    try:
        encoder.load_state_dict(state)
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

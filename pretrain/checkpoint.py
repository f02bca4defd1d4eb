"""Pretraining checkpoints: atomic files, keep-last-K rotation, strict loading.

One file per save, `checkpoint-{step:09d}.pt` in the run's output folder, written to a hidden
temporary name, fsynced and renamed (a killed job never leaves a half-written checkpoint under a
final name). Contents (plain containers of tensors and builtins, so `torch.load(weights_only=True)`
reads them and nothing in the file can run code):

    format       "relicv2-pretrain-checkpoint"      version  1
    config       the resolved config as a nested dict
    step         global steps done                  skipped_steps  non-finite steps skipped
    online       online network state dict          target   target network state dict
    optimizer    LARS state dict
    rng          per rank: {"torch": CPU RNG state, "cuda": [CUDA RNG states]}
    data         per rank: the view loader's state_dict (DALI reader checkpoint or generator position)
"""

from __future__ import annotations

import contextlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from shards.atomic import atomic_output

FORMAT = "relicv2-pretrain-checkpoint"
VERSION = 1
REQUIRED_KEYS = ("config", "step", "online", "target", "optimizer", "rng", "data")
_NAME = re.compile(r"^checkpoint-(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (missing, corrupt, foreign, or from another version)."""


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step:09d}.pt"


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
    """Write `payload` (see module docstring) atomically as this step's file; keep the newest `keep` files."""
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    path = checkpoint_path(output_dir, int(payload["step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        torch.save({"format": FORMAT, "version": VERSION, **payload}, tmp)
    for old in list_checkpoints(output_dir)[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; any unusable file raises one `CheckpointError`.

    Uses `weights_only=True`: the file may come from someone else, and a pickle could run code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path given to --resume")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path} is not a readable relicv2 pretraining checkpoint ({first_line}); it may be truncated "
            "or come from another program: delete it to resume from the previous checkpoint, or pass "
            "another file to --resume"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        held = sorted(payload)[:5] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{path} is not a relicv2 pretraining checkpoint (it holds {held}); pass a checkpoint-*.pt "
            "file written by `relicv2 pretrain`"
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {payload.get('version')}, this relicv2 reads version "
            f"{VERSION}; use the relicv2 release that wrote it"
        )
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; the file is incomplete, delete it and resume from an older one")
    return payload

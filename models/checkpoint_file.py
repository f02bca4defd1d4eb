"""Reading a pretraining checkpoint a user hands over: its file naming, its format and a strict,
code-free load (`torch.load(weights_only=True)` and a check of every field's type).

A leaf both stages use (the saliency network starts from a pretraining run's encoder), apart from
`pretrain.checkpoint`, which writes, rotates and resumes checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from relicv2.models.encoder_file import is_state_dict, sidecar_path
from relicv2.models.untrusted import TORCH_LOAD_ERRORS, load_failure

FORMAT = "relicv2-pretrain-checkpoint"
VERSION = 1
# Every field of a checkpoint and the type the loaders rely on.
FIELD_TYPES = {"config": dict, "step": int, "online": dict, "target": dict, "optimizer": dict, "rng": list,
               "data": list}
REQUIRED_KEYS = tuple(FIELD_TYPES)
_NAME = re.compile(r"^checkpoint-(\d{9})\.pt$")
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
    return sorted(p for p in Path(output_dir).glob("checkpoint-*.pt") if _NAME.match(p.name))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in `output_dir`, or None (for automatic resume)."""
    return max(list_checkpoints(output_dir), default=None)


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
        if step_of(path) is not None:  # a run's own checkpoint, damaged (a killed copy, a full disk)
            fix = ("it may be truncated: delete it (a run then resumes from the previous checkpoint) "
                   "or pass another file")
        else:
            fix = f"pass {_WHAT_TO_PASS}"
        raise CheckpointError(f"{path} is not a readable relicv2 pretraining checkpoint ({load_failure(error)}); "
                              f"{fix}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        if is_state_dict(payload) and "conv1.weight" in payload:  # an exported ResNet without its sidecar
            sidecar = sidecar_path(path).name
            raise CheckpointError(f"{path} is not a relicv2 pretraining checkpoint: it holds a plain encoder "
                                  f"state dict, like an exported encoder whose sidecar {sidecar} is missing "
                                  "(`relicv2 export` writes it beside the .pt): put the sidecar back beside "
                                  "it, or pass a run folder or a checkpoint-*.pt")
        held = sorted(payload)[:5] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a relicv2 pretraining checkpoint (it holds {held}); pass {_WHAT_TO_PASS}")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {payload.get('version')}, this relicv2 "
                              f"reads version {VERSION}; use the relicv2 release that wrote it")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; the file is incomplete, delete it and resume from an older one")
    # Hand-made or damaged files: every field has the type the loaders rely on, checked up front.
    for key, kind in FIELD_TYPES.items():
        value = payload[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: field {key!r} is a {type(value).__name__}, a relicv2 checkpoint "
                                  f"holds a {kind.__name__} there; the file is damaged or hand-made, use a "
                                  "checkpoint written by `relicv2 pretrain`")
    if payload["step"] < 0:
        raise CheckpointError(f"{path}: field 'step' is {payload['step']}; a step count is never negative")
    for network in ("online", "target"):
        bad = [name for name, value in payload[network].items() if not isinstance(value, torch.Tensor)]
        if bad:
            raise CheckpointError(f"{path}: {network}[{bad[0]!r}] is not a tensor; the file is damaged or hand-made")
    return payload


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

"""Reading a pretraining checkpoint a user hands over: its file naming, its format (`models.torchfile`)
and the checks of its contents that go beyond the fields' types.

A leaf both stages use (the saliency network starts from a pretraining run's encoder), apart from
`pretrain.checkpoint`, which writes, rotates and resumes checkpoints.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from relicv2.models.encoder_file import sidecar_path
from relicv2.models.torchfile import StateDict, TorchFileError, TorchFormat, is_state_dict

_NAME = re.compile(r"^checkpoint-(\d{9})\.pt$")


class CheckpointError(TorchFileError):
    """A checkpoint file that cannot be used (missing, corrupt, foreign, or from another version)."""


CHECKPOINT = TorchFormat(
    "relicv2 pretraining checkpoint", tag="relicv2-pretrain-checkpoint", version=1, error=CheckpointError,
    fix=("pass a run folder, a checkpoint-*.pt file written by `relicv2 pretrain` or (to eval) an encoder "
         "exported by `relicv2 export`"),
    fields={"config": dict, "step": int, "online": StateDict, "target": StateDict, "optimizer": dict, "rng": list,
            "data": list})
# A run's own checkpoint that cannot be read was damaged (a killed copy, a full disk): an older one remains.
_DAMAGED = dataclasses.replace(CHECKPOINT, fix="it may be truncated: delete it (a run then resumes from the "
                                               "previous checkpoint) or pass another file")


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


def _format(path: str | Path) -> TorchFormat:
    return CHECKPOINT if step_of(path) is None else _DAMAGED


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; any unusable file raises one `CheckpointError`."""
    return check_checkpoint(path, _format(path).read(path))


def check_checkpoint(path: str | Path, payload: Any) -> dict[str, Any]:
    """`payload`, read from `path`, when it is a usable checkpoint; else a `CheckpointError`."""
    path = Path(path)
    if is_state_dict(payload) and "conv1.weight" in payload:  # an exported ResNet without its sidecar
        raise CheckpointError(f"{path} is not a relicv2 pretraining checkpoint: it holds a plain encoder state "
                              f"dict, like an exported encoder whose sidecar {sidecar_path(path).name} is missing "
                              "(`relicv2 export` writes it beside the .pt): put the sidecar back beside it, or "
                              "pass a run folder or a checkpoint-*.pt")
    payload = _format(path).check(path, payload)
    if payload["step"] < 0:
        raise CheckpointError(f"{path}: field 'step' is {payload['step']}; a step count is never negative")
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

"""The self-describing saliency model file `OUT/model.pt` (readable with `torch.load(weights_only=True)`).

Contents (plain containers only):
    format "relicv2-saliency-model", version 1
    arch        {"name": "dilated-resnet-os8-decoder-v1", "depth": int, "width": int}
    input_size  the square side the network expects
    threshold   foreground threshold of the soft mask (0.5)
    preset, backbone (where the encoder weights came from), config (resolved), report
    state_dict  the network's weights
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relicv2.jobs.atomic import atomic_output
from relicv2.models.checkpoint_file import FORMAT as PRETRAIN_FORMAT
from relicv2.models.resnet import state_dict_differences
from relicv2.models.untrusted import TORCH_LOAD_ERRORS, load_failure
from relicv2.saliency.network.model import SaliencyNet

FORMAT = "relicv2-saliency-model"
VERSION = 1
ARCH = "dilated-resnet-os8-decoder-v1"
MODEL_NAME = "model.pt"  # the model file in a `relicv2 saliency train` output folder
PASS_MODEL = "pass the model.pt written by `relicv2 saliency train`"


class ModelFileError(ValueError):
    """A saliency model file that cannot be used."""


def save_model(path: Path, model: SaliencyNet, *, input_size: int, preset: str, backbone: str,
               config: dict, report: dict, threshold: float = 0.5) -> Path:
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "arch": {"name": ARCH, "depth": model.depth, "width": model.width},
        "input_size": input_size,
        "threshold": threshold,
        "preset": preset,
        "backbone": backbone,
        "config": config,
        "report": report,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        torch.save(payload, tmp)
    return path


def resolve_model_path(path: Path | str) -> Path:
    """The model file `path` names: the file itself, or the model.pt of a `saliency train` output folder."""
    path = Path(path)
    if path.is_dir():
        if not (path / MODEL_NAME).is_file():
            raise ModelFileError(f"{path} is a folder without {MODEL_NAME}; {PASS_MODEL} (its --out folder or the file)")
        return path / MODEL_NAME
    if not path.is_file():
        raise ModelFileError(f"saliency model {path} does not exist; train one with `relicv2 saliency train`")
    return path


def load_model(path: Path | str, device: str = "cpu") -> tuple[SaliencyNet, dict[str, Any]]:
    """(network in eval mode on `device`, the file's description without the weights). `path` is the
    model file or the `saliency train` output folder holding it."""
    path = resolve_model_path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except TORCH_LOAD_ERRORS as error:
        raise ModelFileError(f"{path} is not a saliency model file ({load_failure(error)}); {PASS_MODEL}") from None
    if isinstance(payload, dict) and payload.get("format") == PRETRAIN_FORMAT:
        raise ModelFileError(f"{path} is a relicv2 pretraining checkpoint, not a saliency model; {PASS_MODEL}")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a saliency model file (no '{FORMAT}' format entry); {PASS_MODEL}")
    arch = payload.get("arch")
    if not isinstance(arch, dict):
        raise ModelFileError(f"{path}: its arch entry is a {type(arch).__name__}, not the network's description "
                             f"(name, depth, width); {PASS_MODEL}")
    if payload.get("version") != VERSION or arch.get("name") != ARCH:
        raise ModelFileError(f"{path} is saliency model version {payload.get('version')} ({arch!r:.80}); this relicv2 reads version {VERSION} ({ARCH})")
    depth, width = arch.get("depth"), arch.get("width")
    try:
        if type(depth) is not int or type(width) is not int:
            raise ValueError(f"depth {depth!r:.20} and width {width!r:.20} must be whole numbers")
        model = SaliencyNet(depth, width)
    except ValueError as error:  # a hand-made or damaged description
        raise ModelFileError(f"{path}: its arch entry names no network this relicv2 builds ({error}); {PASS_MODEL}") from None
    state = payload.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ModelFileError(f"{path}: its state_dict entry is not a table of named weight tensors; {PASS_MODEL}")
    differences = state_dict_differences(model.state_dict(), state)
    if differences:
        raise ModelFileError(
            f"{path}: the weights do not fit the ResNet-{depth} x{width} its arch entry records ({differences}); "
            "the file's depth or width setting does not match its weights (edited or written by another tool?); "
            f"{PASS_MODEL}")
    model.load_state_dict(state)
    return model.to(device).eval(), {k: v for k, v in payload.items() if k != "state_dict"}

"""The self-describing saliency model file `OUT/model.pt` (a `models.torchfile` format, so
`torch.load(weights_only=True)` reads it).

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

from relicv2.models.checkpoint_file import CHECKPOINT
from relicv2.models.resnet import state_dict_differences
from relicv2.models.torchfile import StateDict, TorchFileError, TorchFormat
from relicv2.saliency.network.config import input_size_problem
from relicv2.saliency.network.model import SaliencyNet

ARCH = "dilated-resnet-os8-decoder-v1"
MODEL_NAME = "model.pt"  # the model file in a `relicv2 saliency train` output folder
PASS_MODEL = "pass the model.pt written by `relicv2 saliency train`"


class ModelFileError(TorchFileError):
    """A saliency model file that cannot be used."""


MODEL = TorchFormat("saliency model file", fix=PASS_MODEL, tag="relicv2-saliency-model", version=1,
                    fields={"arch": dict, "input_size": int, "state_dict": StateDict}, error=ModelFileError)


def save_model(path: Path, model: SaliencyNet, *, input_size: int, preset: str, backbone: str,
               config: dict, report: dict, threshold: float = 0.5) -> Path:
    return MODEL.save(path, {
        "arch": {"name": ARCH, "depth": model.depth, "width": model.width},
        "input_size": input_size,
        "threshold": threshold,
        "preset": preset,
        "backbone": backbone,
        "config": config,
        "report": report,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    })


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
    payload = MODEL.read(path)
    if isinstance(payload, dict) and payload.get("format") == CHECKPOINT.tag:
        raise MODEL.fail(path, "is a relicv2 pretraining checkpoint, not a saliency model")
    arch, state = MODEL.check(path, payload)["arch"], payload["state_dict"]
    if arch.get("name") != ARCH:
        raise MODEL.fail(path, f"holds a {arch.get('name')!r:.60} network; this relicv2 builds {ARCH}")
    if (problem := input_size_problem(payload["input_size"])) is not None:  # before anything is sized by it
        raise MODEL.fail(path, f"records an impossible input size ({problem})")
    depth, width = arch.get("depth"), arch.get("width")
    try:
        if type(depth) is not int or type(width) is not int:
            raise ValueError(f"depth {depth!r:.20} and width {width!r:.20} must be whole numbers")
        model = SaliencyNet(depth, width)
    except ValueError as error:  # a hand-made or damaged description
        raise MODEL.fail(path, f"has an arch entry that names no network this relicv2 builds ({error})") from None
    differences = state_dict_differences(model.state_dict(), state)
    if differences:
        raise MODEL.fail(path, f"holds weights that do not fit the ResNet-{depth} x{width} its arch entry records "
                               f"({differences}): the file's depth or width setting does not match its weights "
                               "(edited or written by another tool?)")
    model.load_state_dict(state)
    return model.to(device).eval(), {k: v for k, v in payload.items() if k != "state_dict"}

"""Encoder weights for the saliency network, from a file or a run folder; nothing is ever downloaded.

Accepted (`encoder_state_dict(source, depth, width)`, then `load_fitting`):
- a `relicv2 pretrain` checkpoint file or run folder (its newest checkpoint): the online encoder;
- a torchvision-format ResNet state dict (`conv1.weight`, `layer1.0...`; `fc.*` dropped);
- a SwAV-format checkpoint: `{"state_dict": ...}` or a bare dict whose names carry a `module.`
  prefix; the projection head and prototypes are dropped;
- the `relicv2 export` format: a plain state dict plus a `FILE.json` sidecar naming
  "arch"/"depth"/"width", checked against the requested architecture first, or a safetensors file holding
  that description in its metadata (a safetensors file without it: its tensors, named as above).
Every problem is one `BackboneError` naming the file and, for a wrong architecture, the first
mismatched keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from relicv2.models.checkpoint_file import (
    CHECKPOINT,
    CheckpointError,
    check_checkpoint,
    resolve_checkpoint,
)
from relicv2.models.encoder_file import (
    METADATA_KEY,
    PADDING_MARKER,
    ExportError,
    architecture_of,
    is_safetensors,
    read_safetensors,
    sidecar_path,
)
from relicv2.models.resnet import ResNet, load_torchvision_state_dict
from relicv2.models.torchfile import TorchFileError, TorchFormat

# Prefixes stripped from names, in order: DDP's `module.`, then an `encoder.` / `backbone.` wrapper.
WRAPPER_PREFIXES = ("module.", "encoder.", "backbone.", "trunk.")
# Entries of a SwAV (or similar) checkpoint that are not part of the trunk.
DROPPED_PREFIXES = ("projection_head.", "prototypes.", "fc.", "head.", "projector.", "predictor.")


class BackboneError(TorchFileError):
    """A backbone file that cannot initialise the encoder (missing, corrupt, foreign, wrong architecture)."""


WEIGHTS = TorchFormat("weights file", error=BackboneError, fix=(
    "pass a relicv2 pretrain checkpoint or run folder, a torchvision/SwAV ResNet state dict, or --backbone random"))


def _strip(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Trunk entries under torchvision's names: wrapper prefixes removed, heads dropped."""
    out = {}
    for name, value in state.items():
        for prefix in WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        if not name.startswith(DROPPED_PREFIXES):
            out[name] = value
    return out


def _check_sidecar(path: Path, depth: int, width: int) -> str:
    """Refuse a sidecar's other depth or width; return its padding ("torch" when it names none)."""
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return "torch"
    try:
        info = json.loads(sidecar.read_text())
    except (OSError, ValueError) as error:
        raise BackboneError(f"{sidecar} (the sidecar of {path.name}) is not readable JSON ({error})") from None
    return _check_described(info, path, f"{sidecar} (the sidecar of {path.name})", depth, width)


def _check_described(info: Any, path: Path, where: str, depth: int, width: int) -> str:
    """Refuse the depth or width that `info` (a sidecar's content, read from `where`) gives when it is not the
    network's; return its padding ("torch" when it names none)."""
    if not isinstance(info, dict) or info.get("depth") is None:
        return "torch"
    found = (info["depth"], info.get("width") or 1)
    if type(found[0]) is not int or type(found[1]) is not int:
        raise BackboneError(f"{where} gives depth {found[0]!r:.20} and width "
                            f"{found[1]!r:.20}, not whole numbers; rewrite it with `relicv2 export`")
    if found != (depth, width):
        raise BackboneError(
            f"{path} holds a ResNet-{found[0]} at width {found[1]} (per {where}), but the "
            f"saliency network is a ResNet-{depth} at width {width}; set depth={found[0]} "
            f"width={found[1]} (--set) or pass other weights"
        )
    return str(info.get("padding") or "torch")


def _padding_note(padding: str) -> str:
    # The saliency encoder pads as torchvision does (its dilated stages need it): weights made for
    # TensorFlow "SAME" padding (the authors' release) still initialise it, but its features shift.
    return "" if padding == "torch" else (f" (made for {padding} padding; the saliency encoder pads as "
                                          "torchvision does, so its features differ slightly from the source model's)")


def encoder_state_dict(source: str | Path, depth: int, width: int) -> tuple[dict[str, Tensor], str]:
    """(trunk state dict under torchvision names, a description of its kind) from a file or run folder."""
    path = Path(source)
    if is_safetensors(path):  # an export (or timm's weights): no pickle, the sidecar in its metadata
        try:
            payload, info = read_safetensors(path)
        except ExportError as error:
            raise BackboneError(str(error)) from None
        padding = _check_described(info, path, f"the {METADATA_KEY!r} metadata of {path.name}", depth, width)
        payload.pop(PADDING_MARKER, None)
        return _strip(payload), f"safetensors file {path}{_padding_note(padding)}"
    try:
        path = resolve_checkpoint(path) if path.is_dir() else path
        payload = WEIGHTS.load(path)
        if payload.get("format") == CHECKPOINT.tag:
            online = check_checkpoint(path, payload)["online"]
            return ({k.removeprefix("encoder."): v for k, v in online.items() if k.startswith("encoder.")},
                    f"relicv2 pretrain checkpoint {path}")
    except CheckpointError as error:  # a backbone's problem, whatever read it
        raise BackboneError(str(error)) from None
    note = _padding_note(_check_sidecar(path, depth, width))
    kind = "state dict"
    if isinstance(payload.get("state_dict"), dict):  # SwAV / DINO-style training checkpoint
        payload, kind = payload["state_dict"], "SwAV-format checkpoint"
    elif isinstance(payload.get("model"), dict):
        payload, kind = payload["model"], "checkpoint ('model' entry)"
    tensors = {k: v for k, v in payload.items() if isinstance(k, str) and isinstance(v, Tensor)}
    if not tensors:
        raise BackboneError(f"{path} holds no weight tensors (keys {sorted(map(str, payload))[:5]}); it is not a ResNet state dict")
    if kind == "state dict" and any(k.startswith("module.") for k in tensors):
        kind = "SwAV-format checkpoint"
    tensors.pop(PADDING_MARKER, None)  # an imported release's mark (the note above says what it means here)
    return _strip(tensors), f"{kind} {path}{note}"


def load_fitting(encoder: ResNet, state: dict[str, Tensor], source: str | Path, depth: int, width: int) -> None:
    """Load `state` into `encoder` (a `resnet(depth, width)`); a BackboneError naming the settings
    that fit when the file holds another depth or width (read from its tensors' shapes)."""
    try:
        load_torchvision_state_dict(encoder, state)
    except ValueError as error:
        found = architecture_of(state)
        if found is None or found == (depth, width):
            raise BackboneError(f"{source} does not fit a ResNet-{depth} at width {width}: {error}") from None
        fix = " ".join(f"--set {name}={value}" for name, value, wanted in
                       (("depth", found[0], depth), ("width", found[1], width)) if value != wanted)
        raise BackboneError(f"{source} does not fit a ResNet-{depth} at width {width}: it holds a ResNet-{found[0]} "
                            f"at width {found[1]} (read from its tensors); add {fix}") from None

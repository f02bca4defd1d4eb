"""The exported-encoder file format: a plain state dict FILE plus a JSON sidecar FILE + ".json", or one
safetensors file (a FILE named *.safetensors) holding the same tensors, with what the sidecar holds in its
string metadata (under "relicv2", JSON) and no pickle at all.

Two layouts of the names, the sidecar's (or metadata's) "format":
- "torchvision" (width 1): torchvision's parameter names without `fc.*`, so
  `torchvision.models.resnetNN().load_state_dict(sd, strict=False)` takes it with only `fc.weight`
  and `fc.bias` missing (or strictly, after adding an fc of your own);
- "relicv2" (width 2 or 4): this project's `models.resnet.ResNet` names, which torchvision
  cannot express (it does not widen the stem).

An encoder that pads like TensorFlow ("same_tf", the authors' imported weights) cannot be
expressed by torchvision: its strided layers pad asymmetrically, which moves every sample of the
stem by a pixel, so torchvision's network would take the weights and give other features. Such
a file carries one more entry, `PADDING_MARKER` (an empty tensor), which a torchvision load
names (an unexpected key, an error under strict=True), and its sidecar says so under "padding".

The sidecar carries what a reader needs to rebuild the network without the training code
(arch, depth, width, padding, num_features) and what it came from (source checkpoint, network,
step, a config summary, kNN / linear figures when known).

A safetensors file without that metadata (one written by timm or by hand) is read as a torchvision-layout
state dict when its names and shapes are exactly a torchvision ResNet's (`fc.*` ignored): names and shapes
fix the network but for its padding, and the one padding they cannot show (TensorFlow's) is only ever in
files this project writes, marked and described. Anything else is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from relicv2.jobs.atomic import atomic_output, atomic_write_bytes
from relicv2.models.architecture import PADDINGS, STAGE_PLANES, depth_of
from relicv2.models.resnet import (
    ResNet,
    load_torchvision_state_dict,
    resnet,
    to_torchvision_state_dict,
)
from relicv2.models.torchfile import TorchFileError, TorchFormat

FORMATS = ("torchvision", "relicv2")
SIDECAR_SUFFIX = ".json"
PADDING_MARKER = "padding.same_tf"  # in the state dict of an encoder that pads like TensorFlow
SAFETENSORS_SUFFIX = ".safetensors"
METADATA_KEY = "relicv2"  # the safetensors metadata entry holding the sidecar's JSON
HUB_WEIGHTS = "model.safetensors"  # the weights' name in a Hugging Face / timm hub folder
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header's bytes


class ExportError(TorchFileError):
    """An exported encoder file (or its sidecar) that cannot be used; the message names the file and the fix."""


ENCODER = TorchFormat("encoder file", fix="re-export it with `relicv2 export`", state_dict=True, error=ExportError)


def sidecar_path(path: str | Path) -> Path:
    """FILE + ".json" (appended, not replacing the suffix): `encoder.pt` -> `encoder.pt.json`."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def check_output_file(path: str | Path) -> None:
    """Refuse an output path that cannot become the encoder file (call it before any work)."""
    path = Path(path)
    if path.is_dir():
        raise ExportError(f"--out {path} is a folder; give the encoder file's path, e.g. {path / 'encoder.pt'} "
                          f"(its sidecar is written beside it as encoder.pt{SIDECAR_SUFFIX})")
    if path.suffix != SAFETENSORS_SUFFIX and sidecar_path(path).is_dir():
        raise ExportError(f"the sidecar of --out {path} would be {sidecar_path(path)}, which is a folder; "
                          "choose another --out")


def save_encoder_file(encoder: ResNet, path: str | Path, *, depth: int, width: int,
                      metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `encoder` to `path` (state dict, in the format its width allows) and its sidecar atomically;
    a `path` named *.safetensors holds the sidecar in its metadata instead. Return the sidecar dict."""
    path = Path(path)
    check_output_file(path)
    fmt = "torchvision" if width == 1 else "relicv2"
    state = to_torchvision_state_dict(encoder) if fmt == "torchvision" else encoder.state_dict()
    sidecar = {"format": fmt, "arch": f"resnet{depth}" + ("" if width == 1 else f"_{width}x"), "depth": depth,
               "width": width, "padding": encoder.padding, "num_features": encoder.num_features,
               "fc": "not included: the file holds the encoder only (add your own classifier)"}
    if encoder.padding == "same_tf":
        state[PADDING_MARKER] = torch.zeros(0)
        sidecar["padding_note"] = (f"pads like TensorFlow 'SAME': a torchvision ResNet takes these weights "
                                   f"(less the {PADDING_MARKER!r} entry) but gives other features; load the "
                                   "file with models.encoder_file.load_encoder_file")
    sidecar.update(metadata or {})
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    if path.suffix == SAFETENSORS_SUFFIX:
        text = json.dumps(sidecar, sort_keys=True)  # "format": "pt" is what Hugging Face's loaders look for
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            safetensors.torch.save_file(state, tmp, metadata={"format": "pt", METADATA_KEY: text})
        return sidecar
    # The sidecar is written (and renamed) while the weights wait under their temporary name: a failed
    # write of either (a full disk) leaves the pair as it was, never new weights without their sidecar.
    with ENCODER.saving(path, state):
        atomic_write_bytes(sidecar_path(path), (json.dumps(sidecar, indent=2, sort_keys=True) + "\n").encode())
    return sidecar


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The sidecar of an exported file; ExportError when it is missing or malformed."""
    side = sidecar_path(path)
    if not side.is_file():
        raise ExportError(f"{path} has no sidecar {side.name}; export the encoder with `relicv2 export` "
                          "(or write the sidecar with depth, width and format beside it)")
    try:
        info = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ExportError(f"sidecar {side} is not valid JSON ({error}); re-export the encoder") from None
    return _checked_info(info, f"sidecar {side}")


def _checked_info(info: Any, where: str) -> dict[str, Any]:
    """`info` (a sidecar's content, read from `where`) when it describes an encoder; else the ExportError."""
    if not isinstance(info, dict):
        raise ExportError(f"{where} must hold a JSON object; re-export the encoder")
    for key, kind in (("depth", int), ("width", int), ("format", str)):
        if not isinstance(info.get(key), kind):
            raise ExportError(f"{where} lacks a valid {key!r}; re-export the encoder")
    if info["format"] not in FORMATS:
        raise ExportError(f"{where}: unknown format {info['format']!r} (expected one of {list(FORMATS)})")
    if info.get("padding", "torch") not in PADDINGS:
        raise ExportError(f"{where}: unknown padding {info.get('padding')!r} (expected one of {list(PADDINGS)})")
    return info


def is_safetensors(path: str | Path) -> bool:
    """A file named *.safetensors, or one that starts as a safetensors file does (an 8-byte header length
    that fits the file, then "{"); torch's zip and pickle files never do."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            head = file.read(9)
        return path.suffix == SAFETENSORS_SUFFIX or (
            head[8:] == b"{" and int.from_bytes(head[:8], "little") <= path.stat().st_size - 8)
    except OSError:
        return False


def _end(entry: Any) -> int:
    """Where a safetensors header entry's bytes end (0 when the entry does not say)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets[1] if isinstance(offsets, list) and len(offsets) == 2 and type(offsets[1]) is int else 0


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(tensors, the relicv2 metadata or None) of a safetensors file; its header's size and the tensors'
    extent are checked against the file's size before anything is allocated. One ExportError otherwise."""
    fix = "re-export it with `relicv2 export --format safetensors`, or copy the whole file again"
    size = path.stat().st_size
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if size < 8 or not 2 <= length <= min(size - 8, MAX_HEADER):
            raise ExportError(f"{path} is not a safetensors file (its header length does not fit its {size} bytes: "
                              f"truncated, or another kind of file); {fix}")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ExportError(f"{path} is not a safetensors file (its header is not a JSON object); {fix}")
    needed = max((_end(entry) for name, entry in header.items() if name != "__metadata__"), default=0)
    if needed > size - 8 - length:
        raise ExportError(f"{path} is truncated: its header describes {needed} bytes of tensors, the file holds "
                          f"{size - 8 - length}; {fix}")
    try:
        state = safetensors.torch.load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise ExportError(f"{path} is not a readable safetensors file ({error}); {fix}") from None
    text = (header.get("__metadata__") or {}).get(METADATA_KEY)
    if text is None:
        return state, None
    try:
        info = json.loads(text)
    except (TypeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path}: its {METADATA_KEY!r} metadata is not JSON ({error}); re-export it") from None
    return state, _checked_info(info, f"the {METADATA_KEY!r} metadata of {path}")


def is_encoder_file(path: str | Path) -> bool:
    """True when `path` is a file with an export sidecar beside it, or a safetensors file."""
    return Path(path).is_file() and (sidecar_path(path).is_file() or is_safetensors(path))


def encoder_file_in(path: str | Path) -> Path | None:
    """The encoder file `path` names: itself, or the weights of the hub folder it is; None otherwise."""
    path = Path(path)
    return path if is_encoder_file(path) else path / HUB_WEIGHTS if (path / HUB_WEIGHTS).is_file() else None


def exported_network(info: dict[str, Any]) -> str:
    """The network ("online" or "target") an exported file holds, per its sidecar (online when unsaid)."""
    return "target" if info.get("network") == "target" else "online"


def architecture_of(state: dict[str, Any]) -> tuple[int, int] | None:
    """(depth, width) of a ResNet trunk under torchvision's names, read from its tensors' shapes (blocks
    per stage, bottleneck or not, the stem's channels); None when the names are not a ResNet's."""
    stem = state.get("conv1.weight")
    if not isinstance(stem, torch.Tensor) or stem.ndim != 4 or stem.shape[0] % STAGE_PLANES[0]:
        return None
    counts = tuple(len({name.split(".")[1] for name in state if name.startswith(f"layer{stage}.")})
                   for stage in range(1, 5))
    depth = depth_of("layer1.0.conv3.weight" in state, counts)
    return None if depth is None else (depth, stem.shape[0] // STAGE_PLANES[0])


def load_encoder_file(path: str | Path, *, network: str | None = None) -> ResNet:
    """The ResNet of an exported file (see `read_encoder_file`)."""
    return read_encoder_file(path, network=network)[0]


def read_encoder_file(path: str | Path, *, network: str | None = None) -> tuple[ResNet, dict[str, Any]]:
    """(the ResNet, on CPU, of an exported file: `relicv2 export` or `relicv2 import-official`; its sidecar).

    Read by `models.torchfile` (a .pt) or safetensors; a file that does not fit the sidecar's depth/width
    gives one ExportError naming the file. An exported file holds one network: asking for the target
    (`network="target"`) of a file that holds the online one is an ExportError, not a silent swap.
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"encoder file {path} does not exist; check the path")
    state = None
    if is_safetensors(path):
        state, info = read_safetensors(path)
        where = f"its {METADATA_KEY!r} metadata"
        if info is None:  # a plain state dict (timm's, or saved by hand): the tensors must say it all
            found = architecture_of(state)
            if found is None or PADDING_MARKER in state:
                raise ExportError(f"{path} is a safetensors file without relicv2 metadata whose tensors are not a "
                                  f"torchvision ResNet's (e.g. {sorted(state)[:3]}); export the encoder with "
                                  "`relicv2 export --format safetensors`")
            info = {"format": "torchvision", "depth": found[0], "width": found[1], "metadata": "none"}
    else:
        info, where = read_sidecar(path), f"its sidecar {sidecar_path(path).name}"
    if network == "target" and exported_network(info) != "target":
        raise ExportError(f"{path} is an exported encoder holding the {exported_network(info)} network only "
                          f"(per {where}); --network target needs a pretraining checkpoint: "
                          "pass the run folder or its checkpoint-*.pt, or export the target with "
                          "`relicv2 export --network target`")
    state = ENCODER.load(path) if state is None else state
    padding = info.get("padding", "torch")
    # The sidecar decides; a file written before the marker existed may lack it, but a marked file
    # built for "same_tf" read with torch's padding would give other features without any error.
    if state.pop(PADDING_MARKER, None) is not None and padding != "same_tf":
        raise ExportError(f"{path} holds weights that pad like TensorFlow (its {PADDING_MARKER!r} entry), but "
                          f"{where} says padding {padding!r}; set \"padding\": \"same_tf\" there (or re-import the file)")
    try:
        encoder = resnet(info["depth"], info["width"], padding=padding)
        if info["format"] == "torchvision":
            load_torchvision_state_dict(encoder, state)
        else:
            encoder.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError) as error:
        found = architecture_of(state)
        if found is not None and found != (info["depth"], info["width"]):
            raise ExportError(f"{path} does not fit a ResNet-{info['depth']} {info['width']}x as {where} says: it "
                              f"holds a ResNet-{found[0]} at width {found[1]} (read from its tensors); correct the "
                              f"depth and width in {where}, or re-export") from None
        raise ExportError(f"{path} does not fit a ResNet-{info['depth']} {info['width']}x as {where} says: "
                          f"{error}") from None
    return encoder, info

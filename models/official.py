"""Import the authors' released ReLICv2 encoders (JAX/haiku dill pickles) as PyTorch ResNets.

The release (google-deepmind/relicv2 README: R50 1x/2x/4x, R101, R152, R200, R200 2x) is a dill
pickle of {"experiment_state": <named tuple with online_params, target_params, online_state,
target_state, opt_state>, "step": int, "rng": array}. Parameters are haiku dicts of numpy arrays
named like `res_net50/~/block_group_0/~/block_0/~/conv_0` (convolutions HWIO, BatchNorm scale /
offset with the EMA statistics in the state under `.../~/mean_ema` / `var_ema`).

A pickle can run any code while it is read: the file goes through `official_pickle`'s data-only reader.
The haiku networks pad with TensorFlow's "SAME" rule, so the encoder is built with `padding="same_tf"`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relicv2.models.architecture import WIDTHS, depth_of
from relicv2.models.encoder_file import save_encoder_file
from relicv2.models.official_pickle import ReleaseArray, ReleasePickleError, load_release_pickle
from relicv2.models.resnet import ResNet, resnet

ORIGIN_URL = "https://github.com/google-deepmind/relicv2#pretrained-checkpoints"


class OfficialImportError(ValueError):
    """A released checkpoint that cannot be imported (refused, foreign or unexpected); names the file."""


def read_release(path: str | Path) -> dict[str, Any]:
    """Unpickle a release file with the data-only reader of `official_pickle`; OfficialImportError when
    refused or malformed."""
    path = Path(path)
    try:
        data = load_release_pickle(path.read_bytes())
    except ReleasePickleError as error:
        raise OfficialImportError(f"{path}: {error}") from None
    if not isinstance(data, dict) or "experiment_state" not in data:
        raise OfficialImportError(f"{path} holds no 'experiment_state'; it is not a ReLICv2 release checkpoint "
                                  f"(see {ORIGIN_URL})")
    return data


def _params_and_state(experiment_state: Any, network: str, path: Path) -> tuple[dict, dict]:
    """(params, state) of the online or target network; the BYOL/ReLICv2 field order is
    (online_params, target_params, online_state, target_state, ...)."""
    fields = {"online": ("online_params", "online_state", 0, 2), "target": ("target_params", "target_state", 1, 3)}
    params_name, state_name, params_index, state_index = fields[network]
    params = state = None
    if isinstance(experiment_state, dict):
        params, state = experiment_state.get(params_name), experiment_state.get(state_name)
    elif hasattr(experiment_state, params_name):
        params, state = getattr(experiment_state, params_name), getattr(experiment_state, state_name, None)
    elif isinstance(experiment_state, tuple) and len(experiment_state) >= 4:
        params, state = experiment_state[params_index], experiment_state[state_index]
    if not isinstance(params, dict) or not isinstance(state, dict):
        raise OfficialImportError(f"{path}: experiment_state has no {params_name} / {state_name} dicts")
    return _haiku_dict(params, params_name, path), _haiku_dict(state, state_name, path)


def _haiku_dict(value: Any, what: str, path: Path) -> dict[str, Any]:
    """`value` when it is a dict with string keys (haiku's module and parameter names)."""
    if not isinstance(value, dict):
        raise OfficialImportError(f"{path}: {what} is a {type(value).__name__}, not a dict of haiku names")
    for key in value:
        if not isinstance(key, str):
            raise OfficialImportError(f"{path}: {what} has a key of type {type(key).__name__}; haiku names are "
                                      "strings")
    return value


def _array(value: Any, device_axis: bool, name: str, path: Path) -> np.ndarray:
    """The numeric array `value` holds (its first entry along a leading per-device axis)."""
    array = value.array if isinstance(value, ReleaseArray) else value
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        kind = f"a {array.dtype} array" if isinstance(array, np.ndarray) else f"a {type(value).__name__}"
        raise OfficialImportError(f"{path}: {name} is {kind}, not a numeric array")
    if device_axis:
        if array.ndim == 0 or array.shape[0] == 0:
            raise OfficialImportError(f"{path}: {name} has shape {array.shape}, without the leading per-device "
                                      "axis the stem has")
        array = array[0]
    return array


def haiku_to_state_dict(params: dict, state: dict, path: Path,
                        max_values: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """(torchvision-named state dict, depth, width) of the haiku ResNet torso in `params` / `state`.

    More values than `max_values` (the file's size in bytes) are refused: every value of a release
    takes a byte of the file or more, unless one array stands for many parameters (a pickle can
    reference an object again for a few bytes), and each would become a float32 copy.
    """
    stems = [name for name in params if name.endswith("initial_conv")]
    if len(stems) != 1:
        raise OfficialImportError(f"{path}: expected one ResNet torso (one '.../initial_conv'), found {len(stems)}")
    prefix = stems[0][: -len("initial_conv")]
    torso = {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}
    stats = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}

    def entry(tree: dict, module: str, key: str) -> Any:
        if module not in tree:
            raise OfficialImportError(f"{path}: the ResNet torso lacks {prefix + module!r} (params or BatchNorm "
                                      "statistics)")
        values = _haiku_dict(tree[module], prefix + module, path)
        if key not in values:
            raise OfficialImportError(f"{path}: {prefix + module} lacks its {key!r}")
        return values[key]

    values_left = max_values

    def tensor(array: np.ndarray) -> torch.Tensor:
        nonlocal values_left
        values_left -= array.size
        if values_left < 0:
            raise OfficialImportError(f"{path}: the parameters hold more values than the file has bytes (one "
                                      "array stands for several parameters, which no release does)")
        # A copy: `array` may be a read-only view of the file's bytes, in any byte order and numeric dtype.
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))

    stem = entry(torso, "initial_conv", "w")
    device_axis = _array(stem, False, prefix + "initial_conv", path).ndim == 5  # params kept with a per-device axis
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def conv(haiku: str, torch_name: str) -> None:
        weight = _array(entry(torso, haiku, "w"), device_axis, prefix + haiku, path)
        if weight.ndim != 4:
            raise OfficialImportError(f"{path}: {prefix + haiku} has shape {weight.shape}; a convolution kernel "
                                      "is 4-d (height, width, in, out)")
        out[f"{torch_name}.weight"] = tensor(weight.transpose(3, 2, 0, 1))
        used.add(haiku)

    def batchnorm(haiku: str, torch_name: str) -> None:
        def flat(tree: dict, module: str, key: str) -> torch.Tensor:
            return tensor(_array(entry(tree, module, key), device_axis, prefix + module, path).reshape(-1))

        out[f"{torch_name}.weight"] = flat(torso, haiku, "scale")
        out[f"{torch_name}.bias"] = flat(torso, haiku, "offset")
        out[f"{torch_name}.running_mean"] = flat(stats, f"{haiku}/~/mean_ema", "average")
        out[f"{torch_name}.running_var"] = flat(stats, f"{haiku}/~/var_ema", "average")
        out[f"{torch_name}.num_batches_tracked"] = torch.tensor(0)
        used.add(haiku)

    conv("initial_conv", "conv1")
    width, remainder = divmod(out["conv1.weight"].shape[0], 64)
    bottleneck = any("conv_2" in name for name in torso)
    blocks = tuple(len({m.group(1) for n in torso if (m := re.match(rf"block_group_{g}/~/block_(\d+)/", n))})
                   for g in range(4))
    depth = depth_of(bottleneck, blocks)
    if remainder or width not in WIDTHS or depth is None:
        raise OfficialImportError(f"{path}: a ResNet torso with {blocks} blocks per group and a "
                                  f"{64 * width + remainder}-channel stem is not one of the supported encoders")
    batchnorm("initial_batchnorm", "bn1")
    for group, count in enumerate(blocks):
        for block in range(count):
            haiku, name = f"block_group_{group}/~/block_{block}/~/", f"layer{group + 1}.{block}."
            for index in range(3 if bottleneck else 2):
                conv(f"{haiku}conv_{index}", f"{name}conv{index + 1}")
                batchnorm(f"{haiku}batchnorm_{index}", f"{name}bn{index + 1}")
            if f"{haiku}shortcut_conv" in torso:
                conv(f"{haiku}shortcut_conv", f"{name}downsample.0")
                batchnorm(f"{haiku}shortcut_batchnorm", f"{name}downsample.1")
    unused = sorted(set(torso) - used - {"logits"})
    if unused:
        raise OfficialImportError(f"{path}: haiku modules with no place in a torchvision ResNet-{depth}: {unused[:4]}")
    return out, depth, width


def _step(value: Any, path: Path) -> int | None:
    """The release's training step: an int (a numpy scalar reads as one) or a 0-d integer array (None when
    absent)."""
    if isinstance(value, ReleaseArray) and value.array.shape == ():
        value = value.array[()].item()
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise OfficialImportError(f"{path}: 'step' is a {type(value).__name__}, not an integer")


def encoder_from_release(path: str | Path, *, network: str = "online") -> tuple[ResNet, dict[str, Any]]:
    """(ResNet with padding="same_tf", info) of a release file; info has depth, width and step."""
    path = Path(path)
    data = read_release(path)
    params, state = _params_and_state(data["experiment_state"], network, path)
    state_dict, depth, width = haiku_to_state_dict(params, state, path, max_values=path.stat().st_size)
    step = _step(data.get("step"), path)
    # Built without memory on the meta device, then given the file's tensors: strict loading checks
    # every name and shape before anything the size of the network is allocated.
    with torch.device("meta"):
        encoder = resnet(depth, width, padding="same_tf")
    try:
        encoder.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as error:  # torch's message: a header line, then one line per kind of misfit
        misfits = "; ".join(line.strip() for line in str(error).splitlines()[1:] if line.strip())
        raise OfficialImportError(f"{path}: weights do not fit ResNet-{depth} {width}x: {misfits[:600]}") from None
    return encoder, {"depth": depth, "width": width, "step": step}


def import_official_checkpoint(source: str | Path, out: str | Path, *, network: str = "online") -> dict[str, Any]:
    """Convert a release file into this project's export format (torchvision names at width 1)."""
    encoder, info = encoder_from_release(source, network=network)
    return save_encoder_file(encoder, out, depth=info["depth"], width=info["width"], metadata={
        "source": str(source), "origin": "google-deepmind/relicv2 release (JAX/haiku)", "network": network,
        "step": info["step"], "input": "RGB in [0, 1] normalised with the ImageNet mean/std, as the release",
    })

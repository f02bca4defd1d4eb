"""Import the authors' released ReLICv2 encoders (JAX/haiku dill pickles) as PyTorch ResNets.

The release (google-deepmind/relicv2 README: R50 1x/2x/4x, R101, R152, R200, R200 2x) is a dill
pickle of {"experiment_state": <named tuple with online_params, target_params, online_state,
target_state, opt_state>, "step": int, "rng": array}. Parameters are haiku dicts of numpy arrays
named like `res_net50/~/block_group_0/~/block_0/~/conv_0` (convolutions HWIO, BatchNorm scale /
offset with the EMA statistics in the state under `.../~/mean_ema` / `var_ema`).

A pickle can run any code while it is read, so the file goes through `RestrictedUnpickler`: it
builds numpy arrays, dtypes, plain containers and named-tuple look-alikes, and refuses every
other global before anything is called. The haiku networks pad with TensorFlow's "SAME" rule,
so the encoder is built with `padding="same_tf"` and its features equal the JAX model's.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.model.encoder_file import save_encoder_file
from pretrain.model.resnet import STAGE_BLOCKS, ResNet, resnet

ORIGIN_URL = "https://github.com/google-deepmind/relicv2#pretrained-checkpoints"


class OfficialImportError(ValueError):
    """A released checkpoint that cannot be imported (refused, foreign or unexpected); names the file."""


class _StateTuple(tuple):
    """Stand-in for a by-reference named tuple of the release (experiment / optimiser states)."""

    type_name = "state"

    def __new__(cls, *values: Any):
        return tuple.__new__(cls, values)


def _state_class(name: str) -> type:
    return type(name, (_StateTuple,), {"type_name": name})


def _create_namedtuple(name: str, fieldnames: Any, modulename: str = "", defaults: Any = None) -> type:
    """dill's by-value named tuple: rebuilt with collections.namedtuple (which validates the names)."""
    if not isinstance(name, str) or not all(isinstance(f, str) for f in fieldnames):
        raise pickle.UnpicklingError("malformed named tuple in the pickle")
    return collections.namedtuple(name, list(fieldnames))


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Protocol 2 stores bytes as _codecs.encode(latin-1 text); nothing else is accepted.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refused _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _skipped(*_args: Any) -> None:
    """A JAX device array (the release's rng): not needed, not rebuilt (jax is never imported)."""
    return None


_NUMPY_RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}
_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy's own array constructor (multiarray._reconstruct)
_NUMPY_SCALAR = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}
_JAX_ARRAYS = {"_reconstruct_array", "_reconstruct_device_array", "_device_array_reconstruct"}
_STATE_NAME = re.compile(r"^_?[A-Za-z0-9]*State$")
_STATE_MODULES = ("relicv2", "byol", "optax", "haiku", "jaxline", "__main__", "main_loop", "experiment")


def _create_array(function: Any, args: tuple, state: tuple, npdict: Any = None) -> np.ndarray:
    """dill's ndarray reducer, restricted to numpy's own `_reconstruct` + `__setstate__`."""
    if function is not _RECONSTRUCT:
        raise pickle.UnpicklingError("refused an array built by something other than numpy's _reconstruct")
    array = function(*args)
    if type(array) is not np.ndarray:
        raise pickle.UnpicklingError("refused an ndarray subclass")
    array.__setstate__(state)
    if npdict:
        raise pickle.UnpicklingError("refused an ndarray carrying extra attributes")
    return array


class RestrictedUnpickler(pickle.Unpickler):
    """Builds numpy arrays and plain containers only; any other global is refused before it is used."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_RECONSTRUCT:
            return _RECONSTRUCT
        if (module, name) in _NUMPY_SCALAR:
            return _numpy_scalar
        if (module, name) == ("numpy", "ndarray"):
            return np.ndarray
        if (module, name) == ("numpy", "dtype"):
            return np.dtype
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("_codecs", "encode"):
            return _codecs_encode
        if (module, name) == ("dill._dill", "_create_array"):
            return _create_array
        if (module, name) == ("dill._dill", "_create_namedtuple"):
            return _create_namedtuple
        if module.split(".")[0] == "jax" and name in _JAX_ARRAYS:
            return _skipped
        if _STATE_NAME.match(name) and module.split(".")[0] in _STATE_MODULES:
            return _state_class(name)
        raise pickle.UnpicklingError(
            f"refused to load global {module}.{name}: a released ReLICv2 checkpoint holds only numpy arrays "
            "and containers, so this file carries code or is not such a checkpoint (nothing was run)")


def _numpy_scalar(dtype: np.dtype, data: bytes) -> Any:
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise pickle.UnpicklingError("refused a numpy scalar of an object dtype")
    return np.frombuffer(data, dtype=dtype, count=1)[0]


def read_release(path: str | Path) -> dict[str, Any]:
    """Unpickle a release file with `RestrictedUnpickler`; OfficialImportError when refused or malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = RestrictedUnpickler(io.BufferedReader(handle)).load()
    except pickle.UnpicklingError as error:
        raise OfficialImportError(f"{path}: {error}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
        raise OfficialImportError(f"{path} is not a readable ReLICv2 release pickle ({type(error).__name__}: "
                                  f"{error}); download it again from {ORIGIN_URL}") from None
    if not isinstance(data, dict) or "experiment_state" not in data:
        raise OfficialImportError(f"{path} holds no 'experiment_state'; it is not a ReLICv2 release checkpoint "
                                  f"(see {ORIGIN_URL})")
    return data


def _params_and_state(experiment_state: Any, network: str, path: Path) -> tuple[dict, dict]:
    """(params, state) of the online or target network; the BYOL/ReLICv2 field order is
    (online_params, target_params, online_state, target_state, ...)."""
    fields = {"online": ("online_params", "online_state", 0, 2), "target": ("target_params", "target_state", 1, 3)}
    params_name, state_name, params_index, state_index = fields[network]
    if isinstance(experiment_state, dict):
        params, state = experiment_state.get(params_name), experiment_state.get(state_name)
    elif hasattr(experiment_state, params_name):
        params, state = getattr(experiment_state, params_name), getattr(experiment_state, state_name)
    elif isinstance(experiment_state, tuple) and len(experiment_state) >= 4:
        params, state = experiment_state[params_index], experiment_state[state_index]
    else:
        params = state = None
    if not isinstance(params, dict) or not isinstance(state, dict):
        raise OfficialImportError(f"{path}: experiment_state has no {params_name} / {state_name} dicts")
    return params, state


def _array(value: Any, device_axis: bool, name: str, path: Path) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise OfficialImportError(f"{path}: {name} is not a numpy array")
    return value[0] if device_axis else value


def haiku_to_state_dict(params: dict, state: dict, path: Path) -> tuple[dict[str, torch.Tensor], int, int]:
    """(torchvision-named state dict, depth, width) of the haiku ResNet torso in `params` / `state`."""
    stems = [name for name in params if name.endswith("initial_conv")]
    if len(stems) != 1:
        raise OfficialImportError(f"{path}: expected one ResNet torso (one '.../initial_conv'), found {len(stems)}")
    prefix = stems[0][: -len("initial_conv")]
    torso = {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}
    stats = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
    stem = torso["initial_conv"]["w"]
    device_axis = getattr(stem, "ndim", 0) == 5  # params kept with their leading per-device axis
    width, remainder = divmod(_array(stem, device_axis, "initial_conv", path).shape[-1], 64)
    bottleneck = any("conv_2" in name for name in torso)
    blocks = tuple(len({m.group(1) for n in torso if (m := re.match(rf"block_group_{g}/~/block_(\d+)/", n))})
                   for g in range(4))
    depth = next((d for d, (block, layout) in STAGE_BLOCKS.items()
                  if layout == blocks and (block.expansion == 4) == bottleneck), None)
    if remainder or depth is None:
        raise OfficialImportError(f"{path}: a ResNet torso with {blocks} blocks per group and a "
                                  f"{64 * width + remainder}-channel stem is not one of the supported encoders")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def conv(haiku: str, torch_name: str) -> None:
        weight = _array(torso[haiku]["w"], device_axis, haiku, path)
        out[f"{torch_name}.weight"] = torch.from_numpy(np.ascontiguousarray(weight.transpose(3, 2, 0, 1))).float()
        used.add(haiku)

    def batchnorm(haiku: str, torch_name: str) -> None:
        def flat(value: Any, what: str) -> torch.Tensor:
            return torch.from_numpy(np.array(_array(value, device_axis, what, path)).reshape(-1)).float()

        out[f"{torch_name}.weight"] = flat(torso[haiku]["scale"], haiku)
        out[f"{torch_name}.bias"] = flat(torso[haiku]["offset"], haiku)
        out[f"{torch_name}.running_mean"] = flat(stats[f"{haiku}/~/mean_ema"]["average"], haiku)
        out[f"{torch_name}.running_var"] = flat(stats[f"{haiku}/~/var_ema"]["average"], haiku)
        out[f"{torch_name}.num_batches_tracked"] = torch.tensor(0)
        used.add(haiku)

    try:
        conv("initial_conv", "conv1")
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
    except KeyError as error:
        raise OfficialImportError(f"{path}: the ResNet torso lacks {error} (params or BatchNorm statistics)") from None
    unused = sorted(set(torso) - used - {"logits"})
    if unused:
        raise OfficialImportError(f"{path}: haiku modules with no place in a torchvision ResNet-{depth}: {unused[:4]}")
    return out, depth, width


def encoder_from_release(path: str | Path, *, network: str = "online") -> tuple[ResNet, dict[str, Any]]:
    """(ResNet with padding="same_tf", info) of a release file; info has depth, width and step."""
    path = Path(path)
    data = read_release(path)
    params, state = _params_and_state(data["experiment_state"], network, path)
    state_dict, depth, width = haiku_to_state_dict(params, state, path)
    encoder = resnet(depth, width, padding="same_tf")
    try:
        encoder.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:
        raise OfficialImportError(f"{path}: weights do not fit ResNet-{depth} {width}x: {error}") from None
    step = data.get("step")
    return encoder, {"depth": depth, "width": width, "step": int(step) if step is not None else None}


def import_official_checkpoint(source: str | Path, out: str | Path, *, network: str = "online") -> dict[str, Any]:
    """Convert a release file into this project's export format (torchvision names at width 1)."""
    encoder, info = encoder_from_release(source, network=network)
    return save_encoder_file(encoder, out, depth=info["depth"], width=info["width"], metadata={
        "source": str(source), "origin": "google-deepmind/relicv2 release (JAX/haiku)", "network": network,
        "step": info["step"], "input": "RGB in [0, 1] normalised with the ImageNet mean/std, as the release",
    })

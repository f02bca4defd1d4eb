"""Hand-made release pickles, written opcode by opcode, for the import-official refusal and fuzz tests.

`encode` turns a tree of plain values (None, bool, int, float, str, bytes, tuple, list, dict) and the
nodes below into a pickle stream, so a test states a hostile file as the objects it asks the
unpickler to build: `Call(Global("numpy", "ndarray"), (...))` is "call numpy.ndarray with ...".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

RECONSTRUCT = ("numpy.core.multiarray", "_reconstruct")
SCALAR = ("numpy.core.multiarray", "scalar")


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """REDUCE: func(*args)."""
    func: Any
    args: tuple


@dataclass(frozen=True)
class NewObj:
    """NEWOBJ: cls.__new__(cls, *args)."""
    cls: Any
    args: tuple


@dataclass(frozen=True)
class Put:
    """`value`, then LONG_BINPUT: kept in the memo under `index`."""
    value: Any
    index: int


@dataclass(frozen=True)
class Get:
    """LONG_BINGET: the object kept under `index` again (a few bytes, however large it is)."""
    index: int


@dataclass(frozen=True)
class Build:
    """BUILD: obj.__setstate__(state) (or its __dict__ updated)."""
    obj: Any
    state: Any


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2 ** 31) <= value < 2 ** 31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        out += _int(value)
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes):
        out += b"B" + struct.pack("<I", len(value)) + value
    elif isinstance(value, tuple):
        out += b"("
        for item in value:
            _encode(item, out)
        out += b"t"
    elif isinstance(value, list):
        out += b"]("
        for item in value:
            _encode(item, out)
        out += b"e"
    elif isinstance(value, dict):
        out += b"}("
        for key, item in value.items():
            _encode(key, out)
            _encode(item, out)
        out += b"u"
    elif isinstance(value, Global):
        out += b"c" + value.module.encode() + b"\n" + value.name.encode() + b"\n"
    elif isinstance(value, Call):
        _encode(value.func, out)
        _encode(tuple(value.args), out)
        out += b"R"
    elif isinstance(value, NewObj):
        _encode(value.cls, out)
        _encode(tuple(value.args), out)
        out += b"\x81"
    elif isinstance(value, Put):
        _encode(value.value, out)
        out += b"r" + struct.pack("<I", value.index)
    elif isinstance(value, Get):
        out += b"j" + struct.pack("<I", value.index)
    elif isinstance(value, Build):
        _encode(value.obj, out)
        _encode(value.state, out)
        out += b"b"
    else:
        raise TypeError(f"cannot encode {type(value).__name__}")


def encode(value: Any) -> bytes:
    """The pickle (protocol 3 opcodes) that builds `value`."""
    out = bytearray(b"\x80\x03")
    _encode(value, out)
    return bytes(out + b".")


def dtype(name: str, byteorder: str = "<", state: tuple | None = None) -> Build:
    """numpy's own pickle of np.dtype(name): dtype(name, False, True) then BUILD with its state."""
    return Build(Call(Global("numpy", "dtype"), (name, False, True)),
                 state or (3, byteorder, None, None, None, -1, -1, 0))


def array(shape: tuple, dt: Any, raw: bytes, fortran: bool = False) -> Build:
    """numpy's own pickle of an ndarray: _reconstruct(ndarray, (0,), b"b") then BUILD with
    (version, shape, dtype, is_fortran, rawdata)."""
    return Build(Call(Global(*RECONSTRUCT), (Global("numpy", "ndarray"), (0,), b"b")),
                 (1, tuple(shape), dt, fortran, raw))


def release(online_params: Any, online_state: Any = None, step: Any = 1000) -> dict:
    """A release dict around the given online parameters (the experiment state as a plain dict)."""
    return {"experiment_state": {"online_params": online_params, "target_params": {},
                                 "online_state": {} if online_state is None else online_state,
                                 "target_state": {}},
            "step": step}


def numeric(values: np.ndarray) -> Build:
    """numpy's pickle of a plain numeric array."""
    kind = values.dtype.str  # e.g. "<f4", "|i1"
    return array(values.shape, dtype(kind[1:], kind[0]), values.tobytes())


def resnet18_tree(rng: np.random.Generator) -> tuple[dict, dict]:
    """(params, state) of a haiku ResNet-18 torso as the release names them: int8 kernels in {-1, 0, 1}
    (a small file), float32 BatchNorm parameters and statistics that keep the activations in range."""
    prefix = "res_net18/~/"
    params: dict = {}
    state: dict = {}

    def conv(name: str, kernel: int, cin: int, cout: int) -> None:
        params[prefix + name] = {"w": numeric(rng.integers(-1, 2, (kernel, kernel, cin, cout), dtype=np.int8))}

    def batchnorm(name: str, channels: int, fan_in: int) -> None:
        params[prefix + name] = {"scale": numeric(rng.uniform(0.5, 1.5, (1, 1, 1, channels)).astype(np.float32)),
                                 "offset": numeric(rng.normal(0, 0.1, (1, 1, 1, channels)).astype(np.float32))}
        state[f"{prefix}{name}/~/mean_ema"] = {"average": numeric(np.zeros((1, 1, 1, channels), np.float32))}
        state[f"{prefix}{name}/~/var_ema"] = {"average": numeric(np.full((1, 1, 1, channels), fan_in, np.float32))}

    conv("initial_conv", 7, 3, 64)
    batchnorm("initial_batchnorm", 64, 7 * 7 * 3)
    channels = 64
    for group, out in enumerate((64, 128, 256, 512)):
        for block in range(2):
            name = f"block_group_{group}/~/block_{block}/~/"
            cin = channels if block == 0 else out
            conv(name + "conv_0", 3, cin, out)
            batchnorm(name + "batchnorm_0", out, 9 * cin)
            conv(name + "conv_1", 3, out, out)
            batchnorm(name + "batchnorm_1", out, 9 * out)
            if block == 0 and group > 0:
                conv(name + "shortcut_conv", 1, cin, out)
                batchnorm(name + "shortcut_batchnorm", out, cin)
        channels = out
    return params, state

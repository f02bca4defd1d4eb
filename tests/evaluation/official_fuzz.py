"""Hostile release pickles for `import-official`, read in a process of its own.

`python -m tests.evaluation.official_fuzz --cases N --seed S --dir DIR` writes N random pickles
(random opcode streams over the reader's globals and a few forbidden ones, and mutations of valid
release pickles) to DIR/case.pkl one at a time and imports each with `encoder_from_release`. It
exits 1 with a JSON line naming the case when an import raises anything but `OfficialImportError`,
returns an object of a type the reader should never build, runs code (a forbidden `posix.system`
call would create DIR/ran), or allocates more than `allowance(file size)` (tracemalloc, which
sees numpy's buffers and the unpickler's own). A crash leaves the case in DIR/case.pkl; the last
line names its seed. `--files F...` reads given files instead and prints one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import pickle
import struct
import sys
import tracemalloc
from pathlib import Path

import numpy as np

from relicv2.models.official import OfficialImportError, encoder_from_release, read_release
from tests.evaluation.release_pickles import (
    Build,
    Call,
    Global,
    NewObj,
    array,
    dtype,
    encode,
    numeric,
    release,
)

PLAIN_TYPES = (dict, list, tuple, str, bytes, bytearray, int, float, bool, type(None))
READER = "relicv2.models.official_pickle"  # the reader's own stand-ins and named-tuple types are allowed


def allowance(size: int) -> int:
    """Bytes an import of a `size`-byte file may allocate: the file read whole, the arrays' float32 copies
    (4 bytes for each 1-byte element) and pickle's own objects (an empty dict or list costs ~80 bytes for
    its one opcode byte), over a fixed cost for the small structures every import makes."""
    return 2 * 2 ** 20 + 128 * size


# -- random cases ---------------------------------------------------------------------------------------

ALLOWED_GLOBALS = [
    ("numpy", "dtype"), ("numpy", "ndarray"), ("_codecs", "encode"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("collections", "OrderedDict"), ("dill._dill", "_create_array"),
    ("dill._dill", "_create_namedtuple"), ("jax._src.array", "_reconstruct_array"), ("optax", "ScaleByLarsState"),
    ("__main__", "_ExperimentState"),
]
FORBIDDEN_GLOBALS = [
    ("posix", "system"), ("os", "system"), ("builtins", "eval"), ("builtins", "exec"), ("builtins", "getattr"),
    ("numpy", "frombuffer"), ("numpy.core.multiarray", "_ndarray_evil"), ("subprocess", "Popen"),
    ("__builtin__", "eval"), ("copyreg", "_reconstructor"), ("numpy", "load"),
]
WORDS = ["f4", "f8", "i1", "i8", "u2", "b1", "f2", "O8", "V8", "U1", "S4", "<f4", "<", ">", "|", "=", "latin1",
         "latin-1", "utf-8", "b", "C", "F", "experiment_state", "online_params", "online_state", "step", "w",
         "res_net18/~/initial_conv", "average", "_St", "a", "b", "__setstate__", "__dict__", "__class__",
         "__defaults__", "__reduce__", "", "x" * 300]
# Opcodes taking nothing from the file after them.
BARE = [b"N", b"\x88", b"\x89", b")", b"]", b"}", b"(", b"t", b"\x85", b"\x86", b"\x87", b"l", b"d", b"a", b"e",
        b"s", b"u", b"0", b"1", b"2", b"\x94", b"R", b"b", b"\x81", b"\x92", b"o", b"\x93", b".", b"\x8f", b"\x90",
        b"\x91", b"Q", b"\x97", b"\x98"]


def _unicode(text: str) -> bytes:
    raw = text.encode("utf-8")
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))) + raw


def _token(rng: np.random.Generator, marker: str) -> bytes:
    """One piece of an opcode stream: an opcode with its argument, or a short run of them."""
    pick = rng.integers(0, 24)
    if pick < 6:
        return BARE[rng.integers(len(BARE))]
    if pick == 6:
        return b"K" + bytes([rng.integers(256)])
    if pick == 7:
        value = int(rng.choice([0, 1, -1, 3, 8, 2 ** 31 - 1, -(2 ** 31)]))
        return b"J" + struct.pack("<i", value)
    if pick == 8:
        raw = int(rng.choice([10 ** 12, 2 ** 63, 7 * 2 ** 40, 2 ** 100])).to_bytes(16, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if pick == 9:
        return _unicode(WORDS[rng.integers(len(WORDS))])
    if pick == 10:
        data = rng.bytes(int(rng.choice([0, 1, 4, 8, 16, 64, 256])))
        declared = len(data) if rng.random() < 0.8 else int(rng.integers(0, 2 ** 31))
        return b"B" + struct.pack("<I", declared) + data
    if pick == 11:
        declared = int(rng.choice([8, 2 ** 20, 7 * 2 ** 40, 2 ** 62]))
        return bytes(rng.choice([b"\x8e", b"\x96", b"\x8d"])) + struct.pack("<Q", declared) + rng.bytes(8)
    if pick == 12:
        return b"q" + bytes([rng.integers(256)]) if rng.random() < 0.5 else b"h" + bytes([rng.integers(256)])
    if pick == 13:
        index = int(rng.choice([0, 1, 2, 5, 2 ** 16, 2 ** 24, 2 ** 32 - 1]))
        return (b"r" if rng.random() < 0.5 else b"j") + struct.pack("<I", index)
    if pick == 14:
        names = ALLOWED_GLOBALS if rng.random() < 0.75 else FORBIDDEN_GLOBALS
        module, name = names[rng.integers(len(names))]
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    if pick == 15:
        module, name = ALLOWED_GLOBALS[rng.integers(len(ALLOWED_GLOBALS))]
        return _unicode(module) + _unicode(name) + b"\x93"
    if pick == 16:  # a forbidden call, ready to run: it would create the marker file
        return (b"cposix\nsystem\n" + _unicode(f"touch {marker}") + b"\x85R")
    if pick == 17 and rng.random() < 0.3:
        return b")" + b"\x85" * int(rng.integers(1, 3000))
    if pick == 18:
        return b"\x95" + struct.pack("<Q", int(rng.choice([0, 8, 64, 2 ** 40])))
    if pick == 19:
        return bytes([rng.integers(256)])
    if pick == 20:
        return b"G" + struct.pack(">d", float(rng.normal()))
    if pick == 21:
        return b"\x80" + bytes([rng.integers(0, 6)])
    return encode(_template(rng))[2:-1]


def _template(rng: np.random.Generator):
    """A whole object the reader knows, often slightly wrong: an array, a dtype, a scalar, a named tuple."""
    pick = rng.integers(0, 8)
    names = ["f4", "i1", "u8", "b1", "f2", "O8", "V8", "U1"]
    name = names[rng.integers(len(names))]
    byteorder = "<>|="[rng.integers(4)]
    if pick == 0:
        return dtype(name, byteorder)
    if pick == 1:  # forged states: fields, objects, flags
        state = (3, "|", None, ("f",), {"f": (dtype("O8", "|", (3, "|", None, None, None, -1, -1, 0)), 0)}, 8, 1,
                 int(rng.choice([0, 27, 63])))
        return dtype(name, byteorder, state)
    shape = tuple(int(n) for n in rng.choice([0, 1, 2, 3, 7, 64, 10 ** 12], size=rng.integers(0, 4)))
    count = int(np.prod(shape, dtype=object)) if shape else 1
    size = int(rng.choice([0, 1, 8, 16, 64]) if rng.random() < 0.5 else min(count, 4096) * 4)
    if pick == 2:
        return array(shape, dtype(name, byteorder), rng.bytes(size), fortran=bool(rng.random() < 0.3))
    if pick == 3:
        return Call(Global("numpy", "ndarray"), (shape, dtype(name, byteorder), rng.bytes(size), 0,
                                                 tuple(0 for _ in shape)))
    if pick == 4:
        return Call(Global("numpy.core.multiarray", "scalar"), (dtype(name, byteorder), rng.bytes(size % 9)))
    if pick == 5:
        return Call(Global("numpy._core.numeric", "_frombuffer"), (rng.bytes(size), dtype(name, byteorder), shape, "C"))
    if pick == 6:
        fields = tuple(WORDS[rng.integers(len(WORDS))] for _ in range(rng.integers(0, 4)))
        record = Call(Global("dill._dill", "_create_namedtuple"), ("_St", fields, "__main__"))
        return Call(record, tuple(range(len(fields))))
    return Call(Global("dill._dill", "_create_array"),
                (Global("numpy.core.multiarray", "_reconstruct"), (Global("numpy", "ndarray"), (0,), b"b"),
                 (1, shape, dtype(name, byteorder), False, rng.bytes(size)), None))


def _valid_release(rng: np.random.Generator) -> bytes:
    """A small release as numpy, pickle and this project's writer produce it, at a random protocol."""
    values = {"w": rng.normal(size=(3, 3, 2, 4)).astype(np.float32), "b": np.arange(4, dtype=">i8"),
              "m": np.asfortranarray(np.ones((2, 3), np.float16)), "flag": np.array([True, False])}
    if rng.random() < 0.5:
        return encode(release({"res_net18/~/initial_conv": {k: numeric(v) for k, v in values.items()}}, {},
                              step=Call(Global("numpy.core.multiarray", "scalar"), (dtype("i8"), bytes(8)))))
    tree = {"experiment_state": {"online_params": {"res_net18/~/initial_conv": values}, "online_state": {}},
            "step": np.int64(5)}
    return pickle.dumps(tree, protocol=int(rng.integers(2, 6)))


def _mutate(data: bytes, rng: np.random.Generator, marker: str) -> bytes:
    data = bytearray(data)
    for _ in range(rng.integers(1, 4)):
        where = int(rng.integers(0, len(data) + 1))
        pick = rng.integers(0, 6) if rng.random() < 0.5 else 0
        if pick == 0 and data:
            data[min(where, len(data) - 1)] = rng.integers(256)
        elif pick == 1:
            data[where:where] = _token(rng, marker)
        elif pick == 2:
            del data[where:where + int(rng.integers(1, 16))]
        elif pick == 3:
            data[where:where] = data[where:where + int(rng.integers(1, 64))]
        elif pick == 4:
            del data[where:]
        else:
            data[where:where + 4] = struct.pack("<I", int(rng.choice([0, 2 ** 31 - 1, 2 ** 32 - 1, 10 ** 9])))
    return bytes(data)


def _leaf(rng: np.random.Generator):
    pick = rng.integers(0, 8)
    if pick == 0:
        return None
    if pick == 1:
        return bool(rng.random() < 0.5)
    if pick == 2:
        return int(rng.choice([0, 1, -1, 3, 8, 64, 10 ** 12, 2 ** 70]))
    if pick == 3:
        return float(rng.normal())
    if pick == 4:
        return rng.bytes(int(rng.choice([0, 1, 8, 64])))
    return WORDS[rng.integers(len(WORDS))]


def _random_object(rng: np.random.Generator, marker: str, depth: int = 0):
    """A random tree of calls of the reader's globals (and forbidden ones), BUILDs and containers: always a
    well-formed pickle, so the reader's stand-ins get the hostile arguments, not the opcode parser."""
    pick = rng.integers(0, 12) if depth < 4 else 0
    if pick <= 1:
        return _leaf(rng)
    if pick == 2:
        names = ALLOWED_GLOBALS if rng.random() < 0.8 else FORBIDDEN_GLOBALS
        return Global(*names[rng.integers(len(names))])
    if pick == 3:
        func = _random_object(rng, marker, 3) if rng.random() < 0.2 else Global(
            *ALLOWED_GLOBALS[rng.integers(len(ALLOWED_GLOBALS))])
        return Call(func, tuple(_random_object(rng, marker, depth + 1) for _ in range(rng.integers(0, 6))))
    if pick == 4:
        return Build(_random_object(rng, marker, depth + 1), _random_object(rng, marker, depth + 1))
    if pick == 5:
        return NewObj(_random_object(rng, marker, depth + 1),
                      tuple(_random_object(rng, marker, depth + 1) for _ in range(rng.integers(0, 4))))
    if pick == 6:
        return tuple(_random_object(rng, marker, depth + 1) for _ in range(rng.integers(0, 5)))
    if pick == 7:
        return [_random_object(rng, marker, depth + 1) for _ in range(rng.integers(0, 5))]
    if pick == 8:
        return {WORDS[rng.integers(len(WORDS))]: _random_object(rng, marker, depth + 1)
                for _ in range(rng.integers(0, 4))}
    if pick == 9:
        return Call(Global("posix", "system"), (f"touch {marker}",))
    return _template(rng)


def fuzz_case(seed: int, marker: str) -> bytes:
    """Case `seed`: a random tree of calls (40%), a mutated valid release (30%) or a random opcode stream."""
    rng = np.random.default_rng(seed)
    kind = rng.random()
    if kind < 0.4:
        value = _random_object(rng, marker)
        if rng.random() < 0.5:  # where the import looks: the stem, the step, the experiment state
            where = rng.integers(0, 3)
            value = release({"res_net18/~/initial_conv": {"w": value}}) if where == 0 else (
                release({}, step=value) if where == 1 else {"experiment_state": value})
        return encode(value)
    if kind < 0.7:
        return _mutate(_valid_release(rng), rng, marker)
    body = b"".join(_token(rng, marker) for _ in range(rng.integers(1, 40)))
    return b"\x80" + bytes([rng.integers(2, 6)]) + body + (b"." if rng.random() < 0.9 else b"")


# -- reading one file -----------------------------------------------------------------------------------


def _foreign_object(value) -> str | None:
    """The type name of the first object in `value` that the reader should never build, else None."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        if type(item) in PLAIN_TYPES:
            continue
        if isinstance(item, type):
            if item.__module__ != READER:
                return f"class {item.__module__}.{item.__qualname__}"
        elif type(item).__module__ != READER:
            return f"{type(item).__module__}.{type(item).__qualname__}"
    return None


def read_one(path: Path) -> dict:
    """Import `path` and say how: {"error": one line or None, "foreign": ..., "peak": bytes allocated}."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    foreign = error = None
    try:
        foreign = _foreign_object(read_release(path))
        encoder_from_release(path)
    except OfficialImportError as refused:
        error = str(refused)
    return {"error": error, "foreign": foreign, "peak": tracemalloc.get_traced_memory()[1] - before}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", nargs="*", default=[])
    parser.add_argument("--cases", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    tracemalloc.start()
    for name in args.files:
        print(json.dumps({"start": name}), flush=True)  # a crash leaves this as the last line
        print(json.dumps({"file": name, **read_one(Path(name))}), flush=True)
    if not args.cases:
        return 0
    marker, path = args.dir / "ran", args.dir / "case.pkl"
    path.write_bytes(_valid_release(np.random.default_rng(0)))
    read_one(path)  # the first import's one-off costs (lazy imports, caches) are no file's doing
    refused = imported = largest_peak = 0
    worst = 0.0  # bytes allocated per byte of file, among files of 1 KiB or more
    for seed in range(args.seed, args.seed + args.cases):
        data = fuzz_case(seed, str(marker))
        path.write_bytes(data)
        outcome = {"seed": seed, "size": len(data)}
        try:
            outcome.update(read_one(path))
        except BaseException as error:  # noqa: BLE001 - the finding is whatever escaped, reported with its seed
            outcome["escaped"] = f"{type(error).__name__}: {error}"[:300]
        ran = marker.exists()
        if "escaped" in outcome or outcome["foreign"] or ran or outcome["peak"] > allowance(len(data)):
            print(json.dumps({"failure": {**outcome, "ran_code": ran}}), flush=True)
            return 1
        refused += outcome["error"] is not None
        imported += outcome["error"] is None
        largest_peak = max(largest_peak, outcome["peak"])
        if len(data) >= 1024:
            worst = max(worst, outcome["peak"] / len(data))
    print(json.dumps({"cases": args.cases, "refused": refused, "imported": imported, "largest_peak": largest_peak,
                      "worst_peak_per_file_byte_from_1KiB": round(worst, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

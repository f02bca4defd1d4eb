"""A data-only reader for the authors' release pickles: arrays of plain numeric dtypes, numbers,
plain containers and named-tuple look-alikes, nothing else.

A pickle is a program: the reader resolves each global the file names and calls it with arguments
taken from the file. So no real numpy callable is ever handed out: numpy's own `dtype.__setstate__`
forges a structured dtype with an object field from file bytes, and `ndarray(shape, dtype, buffer,
offset, strides)` turns file bytes into object pointers or reads past its buffer. `numpy.dtype`,
`_reconstruct`, `scalar` and `_frombuffer` resolve to stand-ins that accept exactly the forms numpy
writes (a dtype named by a string such as "f4", then a BUILD with its byte order; an array as
(version, shape, dtype, is_fortran, raw bytes)) and build each array themselves, as a view of the
raw bytes once shape x itemsize is checked to equal their length, so no array outgrows the file.

Before anything is built, the opcode stream is read once with `pickletools.genops`, which runs
nothing, because CPython's unpickler trusts the file in three places: it allocates a declared length
or a memo index before reading it (a few bytes ask for gigabytes), and it hashes a dict key
recursively (a tuple nested a million deep, one byte a level, overflows the C stack).
"""

from __future__ import annotations

import collections
import io
import keyword
import math
import pickle
import pickletools
import re
from typing import Any

import numpy as np

# Plain numeric dtypes, as numpy names them in its pickles: no fields, objects, subarrays or void.
NUMERIC_DTYPES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"})
# Opcodes no release uses: sets (the most memory per byte of file), persistent ids, the extension
# registry and out-of-band buffers.
_REFUSED_OPCODES = frozenset({"EMPTY_SET", "ADDITEMS", "FROZENSET", "PERSID", "BINPERSID", "EXT1", "EXT2",
                              "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"})
MAX_TUPLE_DEPTH = 100  # releases nest tuples a few levels; hashing recurses once per level
MAX_RECORD_TYPES = 64  # named-tuple types a file may define (each costs a class)
MAX_RECORD_FIELDS = 32
MAX_ARRAY_DIMS = 32

_NUMPY_CORES = ("numpy.core", "numpy._core")  # numpy 1 and 2 name the module of their pickling helpers apart
_JAX_ARRAYS = frozenset({"_reconstruct_array", "_reconstruct_device_array", "_device_array_reconstruct"})
_STATE_NAME = re.compile(r"^_?[A-Za-z0-9]*State$")
_STATE_MODULES = ("relicv2", "byol", "optax", "haiku", "jaxline", "__main__", "main_loop", "experiment")
# What unpickling malformed bytes raises (a missing memo entry, a call with the wrong arguments,
# bytes that are no utf-8, a stack emptied too early, a hash recursing too deep for the guard).
_MALFORMED = (ValueError, TypeError, AttributeError, IndexError, KeyError, EOFError, OverflowError, RecursionError)


class ReleasePickleError(ValueError):
    """A release pickle refused (it asks for something other than data) or unreadable; says why."""


def _short(text: Any, limit: int = 80) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


class ReleaseArray:
    """An array of the release: numpy's `_reconstruct(ndarray, (0,), b"b")` stand-in, given its data by
    the BUILD that follows it. `array` is a numpy view of the file's bytes (read-only unless protocol 5
    stored them as a bytearray)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray | None = None) -> None:
        self.array = array

    def __setstate__(self, state: Any) -> None:
        if self.array is not None:
            raise ReleasePickleError("refused a second BUILD on an array")
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise ReleasePickleError("refused an array state that is not (version, shape, dtype, is_fortran, data)")
        if len(state) == 5:
            if type(state[0]) is not int or state[0] != 1:
                raise ReleasePickleError("refused an array state of an unknown version")
            state = state[1:]
        shape, dtype, fortran, raw = state
        if type(fortran) is not bool:
            raise ReleasePickleError("refused an array state whose is_fortran is not a bool")
        self.array = _array(raw, dtype, shape, "F" if fortran else "C")


class _Dtype:
    """numpy.dtype(name, align, copy) of a plain numeric dtype, completed by the BUILD giving its byte order."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype: np.dtype | None = None

    def __setstate__(self, state: Any) -> None:
        # numpy writes (3, byteorder, subarray, names, fields, itemsize, alignment, flags) and, for a plain
        # numeric dtype, exactly (3, "<" | ">" | "|", None, None, None, -1, -1, 0).
        if self.dtype is not None:
            raise ReleasePickleError("refused a second BUILD on a dtype")
        if not (isinstance(state, tuple) and len(state) == 8 and all(type(v) is int for v in state[5:]) and
                type(state[0]) is int and state[0] == 3 and state[2:5] == (None, None, None) and
                state[5:] == (-1, -1, 0)):
            raise ReleasePickleError(f"refused a dtype state for {self.name!r} other than a plain byte order "
                                     "(no fields, objects or subarrays)")
        byteorder = state[1]
        if byteorder not in ("<", ">", "|", "=") or (byteorder == "|" and np.dtype(self.name).itemsize != 1):
            raise ReleasePickleError(f"refused byte order {_short(repr(byteorder), 8)} for dtype {self.name!r}")
        self.dtype = np.dtype(self.name).newbyteorder("=" if byteorder == "|" else byteorder)


def _numeric_dtype(dtype: Any) -> np.dtype:
    if not isinstance(dtype, _Dtype):
        raise ReleasePickleError("refused an array or scalar whose dtype is not a plain numeric numpy dtype")
    if dtype.dtype is None:
        raise ReleasePickleError(f"refused dtype {dtype.name!r} used before its byte order was set")
    return dtype.dtype


def _array(raw: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    """A view of `raw` as an array, once the shape is checked to cover exactly its bytes."""
    dtype = _numeric_dtype(dtype)
    if not isinstance(raw, (bytes, bytearray)):
        raise ReleasePickleError("refused an array whose data is not a byte string")
    if not (isinstance(shape, tuple) and len(shape) <= MAX_ARRAY_DIMS and
            all(type(n) is int and n >= 0 for n in shape)):
        raise ReleasePickleError(f"refused an array shape that is not up to {MAX_ARRAY_DIMS} non-negative ints")
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw):
        raise ReleasePickleError(f"refused an array of shape {_short(shape, 60)} and dtype {dtype.str}: it needs "
                                 f"{count * dtype.itemsize} bytes, the file holds {len(raw)}")
    if order not in ("C", "F"):
        raise ReleasePickleError("refused an array order other than 'C' or 'F'")
    return np.frombuffer(raw, dtype=dtype).reshape(shape, order=order)


def _ndarray(*_args: Any) -> None:
    """What `numpy.ndarray` resolves to: a name `_reconstruct` checks for. Calling it is refused: numpy's
    ndarray(shape, dtype, buffer, offset, strides) would trust the file's strides (a stride of 0 makes a
    one-byte buffer look like gigabytes)."""
    raise ReleasePickleError("refused a call of numpy.ndarray: arrays are read only in the form numpy "
                             "pickles them (_reconstruct, then their shape, dtype and bytes)")


def _reconstruct(subtype: Any, shape: Any, typecode: Any) -> ReleaseArray:
    # numpy pickles every array as _reconstruct(ndarray, (0,), b"b") followed by a BUILD with its data.
    if subtype is not _NDARRAY or shape != (0,) or typecode != b"b":
        raise ReleasePickleError("refused _reconstruct with arguments other than (numpy.ndarray, (0,), b'b')")
    return ReleaseArray()


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> ReleaseArray:
    """numpy's pickle (protocol 5) of a contiguous array: _frombuffer(data, dtype, shape, order)."""
    return ReleaseArray(_array(buffer, dtype, shape, order))


def _dtype(name: Any, align: Any = False, copy: Any = True) -> _Dtype:
    if not isinstance(name, str) or name not in NUMERIC_DTYPES or align not in (False, 0) or copy not in (True, 1):
        raise ReleasePickleError(f"refused numpy dtype {_short(repr(name), 20)}: arrays are read only with plain "
                                 f"numeric dtypes ({', '.join(sorted(NUMERIC_DTYPES))})")
    return _Dtype(name)


def _scalar(dtype: Any, data: Any) -> Any:
    dtype = _numeric_dtype(dtype)
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise ReleasePickleError(f"refused a numpy scalar of dtype {dtype.str} whose data is not {dtype.itemsize} bytes")
    # A Python number: numpy's scalars carry a __setstate__ of their own that a BUILD would reach.
    return np.frombuffer(data, dtype=dtype)[0].item()


def _refuse_state(self: Any, state: Any) -> None:
    raise ReleasePickleError(f"refused a BUILD on a {type(self).__name__}")


class _StandIn:
    """A global of the file, resolved: calls through to one of the functions above. Its own type, so
    that a BUILD cannot set attributes on a function (its defaults, say) for the rest of the process."""

    __slots__ = ("_function",)
    __setstate__ = _refuse_state

    def __init__(self, function: Any) -> None:
        self._function = function

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)


_NDARRAY = _StandIn(_ndarray)


class _StateTuple(tuple):
    """Stand-in for a by-reference named tuple of the release (experiment / optimiser states)."""

    __slots__ = ()
    __setstate__ = _refuse_state

    def __new__(cls, *values: Any):
        if len(values) > MAX_RECORD_FIELDS:
            raise ReleasePickleError(f"refused a {cls.__name__} of {len(values)} fields")
        return tuple.__new__(cls, values)


class _ReleaseUnpickler(pickle.Unpickler):
    """Resolves the release's globals to the stand-ins above; any other global is refused before use."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._encode_allowance = len(data)
        self._records: dict[tuple, type] = {}
        self.arrays: list[ReleaseArray] = []
        self._reconstruct_global = _StandIn(self._reconstruct)
        self._globals: dict[tuple[str, str], Any] = {
            ("numpy", "ndarray"): _NDARRAY,
            ("numpy", "dtype"): _StandIn(_dtype),
            ("_codecs", "encode"): _StandIn(self._codecs_encode),
            # OrderedDict pickles as OrderedDict() followed by SETITEMS; a plain dict keeps the order.
            ("collections", "OrderedDict"): _StandIn(lambda: {}),
            ("dill._dill", "_create_array"): _StandIn(self._create_array),
            ("dill._dill", "_create_namedtuple"): _StandIn(self._create_namedtuple),
        }
        for core in _NUMPY_CORES:
            self._globals[f"{core}.multiarray", "_reconstruct"] = self._reconstruct_global
            self._globals[f"{core}.multiarray", "scalar"] = _StandIn(_scalar)
            self._globals[f"{core}.numeric", "_frombuffer"] = _StandIn(_frombuffer)  # arrays with their data

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module.split(".")[0] == "jax" and name in _JAX_ARRAYS:
            # A JAX device array (the release's rng): not needed, not rebuilt (jax is never imported).
            return _StandIn(lambda *_args: None)
        if _STATE_NAME.match(name) and module.split(".")[0] in _STATE_MODULES:
            return self._record(("state", name), lambda: type(name, (_StateTuple,), {"__slots__": ()}))
        raise ReleasePickleError(
            f"refused to load global {_short(module)}.{_short(name)}: a released ReLICv2 checkpoint holds only "
            "numpy arrays and containers, so this file carries code or is not such a checkpoint (nothing was run)")

    def _reconstruct(self, *args: Any) -> ReleaseArray:
        array = _reconstruct(*args)
        self.arrays.append(array)
        return array

    def _create_array(self, function: Any, args: Any, state: Any, npdict: Any = None) -> ReleaseArray:
        """dill's ndarray reducer, restricted to numpy's own `_reconstruct` + `__setstate__`."""
        if function is not self._reconstruct_global or not isinstance(args, tuple):
            raise ReleasePickleError("refused an array built by something other than numpy's _reconstruct")
        if npdict:
            raise ReleasePickleError("refused an ndarray carrying extra attributes")
        array = function(*args)
        array.__setstate__(state)
        return array

    def _codecs_encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        # Protocol 2 stores bytes as _codecs.encode(latin-1 text); their total cannot exceed the file's
        # size unless one text is encoded again and again (a copy for every few bytes of file).
        if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
            raise ReleasePickleError(f"refused _codecs.encode with encoding {_short(repr(encoding), 20)}")
        self._encode_allowance -= len(text)
        if self._encode_allowance < 0:
            raise ReleasePickleError("refused byte strings adding up to more than the file's size")
        return text.encode("latin1")

    def _create_namedtuple(self, name: Any, fieldnames: Any, modulename: Any = None, defaults: Any = None) -> type:
        """dill's by-value named tuple, rebuilt with collections.namedtuple (which checks the names)."""
        if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and len(name) <= 100
                and isinstance(fieldnames, (tuple, list)) and len(fieldnames) <= MAX_RECORD_FIELDS
                and all(isinstance(f, str) and len(f) <= 100 for f in fieldnames)):
            raise ReleasePickleError("refused a malformed named tuple")

        def build() -> type:
            record = collections.namedtuple(name, list(fieldnames))
            record.__setstate__ = _refuse_state
            return record

        return self._record(("namedtuple", name, tuple(fieldnames)), build)

    def _record(self, key: tuple, build: Any) -> type:
        if key not in self._records:
            if len(self._records) >= MAX_RECORD_TYPES:
                raise ReleasePickleError(f"refused more than {MAX_RECORD_TYPES} named-tuple types")
            self._records[key] = build()
        return self._records[key]


class _StackModel:
    """The unpickler's stack and memo, holding for each object how deep tuples nest in it."""

    def __init__(self) -> None:
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}

    def pop(self, count: int) -> list[int]:
        fence = self.marks[-1] if self.marks else 0
        if len(self.stack) - fence < count:
            raise ReleasePickleError("not a readable pickle (its stack runs empty)")
        items = self.stack[len(self.stack) - count:] if count else []
        del self.stack[len(self.stack) - count:]
        return items

    def pop_mark(self) -> list[int]:
        if not self.marks:
            raise ReleasePickleError("not a readable pickle (a mark is missing)")
        fence = self.marks.pop()
        items = self.stack[fence:]
        del self.stack[fence:]
        return items

    def push(self, depth: int) -> None:
        if depth > MAX_TUPLE_DEPTH:
            raise ReleasePickleError(f"refused tuples nested more than {MAX_TUPLE_DEPTH} deep")
        self.stack.append(depth)

    def step(self, name: str, arg: Any, opcode: pickletools.OpcodeInfo) -> None:
        if name == "MARK":
            self.marks.append(len(self.stack))
        elif name == "POP":
            if self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()
            else:
                self.pop(1)
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            top = self.pop(1)[0]
            self.push(top)
            self.push(top)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            top = self.pop(1)[0]
            self.push(top)
            self.memo[len(self.memo) if name == "MEMOIZE" else arg] = top
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise ReleasePickleError(f"not a readable pickle (memo entry {arg} is read before it is written)")
            self.push(self.memo[arg])
        elif name == "EMPTY_TUPLE":
            self.push(1)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            self.push(1 + max(self.pop(int(name[-1]))))
        elif name in ("TUPLE", "INST", "OBJ"):
            self.push(1 + max(self.pop_mark(), default=0))
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            # A call's result (a named tuple included) nests no deeper than its arguments.
            self.push(max(self.pop(3 if name == "NEWOBJ_EX" else 2)))
        elif name in ("APPENDS", "SETITEMS"):
            self.pop_mark()
            self.push(self.pop(1)[0])
        elif name in ("APPEND", "SETITEM", "BUILD"):
            self.push(self.pop(3 if name == "SETITEM" else 2)[0])
        elif name in ("LIST", "DICT"):
            self.pop_mark()
            self.push(0)
        else:
            if any(item is pickletools.markobject for item in opcode.stack_before):
                raise ReleasePickleError(f"refused opcode {name}")
            self.pop(len(opcode.stack_before))
            for _ in opcode.stack_after:
                self.push(0)


def check_opcodes(data: bytes) -> None:
    """Read the opcode stream without running it; ReleasePickleError when a length or memo index points
    past the file, tuples nest too deep to hash, or an opcode no release uses appears."""
    model = _StackModel()
    try:
        for count, (opcode, arg, position) in enumerate(pickletools.genops(data), start=1):
            name = opcode.name
            if name in _REFUSED_OPCODES:
                raise ReleasePickleError(f"refused opcode {name} at byte {position}: no release uses it")
            if name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > count:
                # The unpickler sizes its memo by the largest index: 5 bytes could ask for 32 GiB.
                raise ReleasePickleError(f"refused memo index {arg} at byte {position}")
            if name == "FRAME" and arg > len(data) - position:
                raise ReleasePickleError(f"refused a frame of {arg} bytes at byte {position}: the file is shorter")
            if name == "STOP":
                model.pop(1)
                return
            model.step(name, arg, opcode)
    except ReleasePickleError:
        raise
    except ValueError as error:  # pickletools: an unknown opcode, a length past the end, no STOP
        raise ReleasePickleError(f"not a readable pickle ({_short(error, 120)})") from None


def load_release_pickle(data: bytes) -> Any:
    """The object a release pickle holds, built from data only; ReleasePickleError when it is refused or
    unreadable. Arrays come back as `ReleaseArray`s (their `.array` a read-only view of `data`)."""
    check_opcodes(data)
    unpickler = _ReleaseUnpickler(data)
    try:
        result = unpickler.load()
    except ReleasePickleError:
        raise
    except pickle.UnpicklingError as error:
        raise ReleasePickleError(f"not a readable pickle ({_short(error, 120)})") from None
    except _MALFORMED as error:
        raise ReleasePickleError(f"not a readable pickle ({type(error).__name__}: {_short(error, 120)})") from None
    if any(array.array is None for array in unpickler.arrays):
        raise ReleasePickleError("refused an array without its data (no BUILD after _reconstruct)")
    return result

"""The one reader and writer of the project's torch files: pretraining checkpoints, exported encoders,
backbone weights, saliency models and their training work files, feature caches, evaluation state files.

A format is a declaration (`TorchFormat`: its tag, version and required fields with their types); its
module keeps only its own domain checks. Writing tags the payload and goes through `jobs.atomic`, so a
final name only ever holds a complete file. Reading is `torch.load(weights_only=True)` only: a file may
come from someone else, and nothing in it may run. Every way a file can fail (missing, not a torch file,
cut short, a pickle that would run code, another format, a newer version, a missing or mistyped field)
is one `TorchFileError` whose message is one line naming the file and what to do, never torch's advice
to retry with `weights_only=False` or to allowlist globals: running the file's code is never the way out.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relicv2.jobs.atomic import atomic_output

# A zip torch cannot open, an unpickler meeting bytes that are no pickle (text -> KeyError, a short
# file -> IndexError/EOFError/struct.error), a refused global (UnpicklingError), an unreadable file.
TORCH_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError,
                     KeyError, IndexError, struct.error)


class TorchFileError(ValueError):
    """A torch file that cannot be used; the message is one line naming the file and what to do."""


class StateDict:
    """A field's type: a dict of named tensors, as `Module.state_dict()` gives."""


Kind = type | tuple[type, ...]  # a field's type (StateDict among them)


def load_failure(error: BaseException) -> str:
    """Why `torch.load(weights_only=True)` could not read a file, in one line, without torch's advice to
    run the file's code."""
    for line in str(error).strip().splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if line and "weights_only" not in line and not line.startswith(
                ("Weights only load failed", "(1)", "(2)", "Please file", "Check the documentation")):
            break
    else:
        line = ""
    # Text or random bytes read as a pickle: a byte that is no opcode, or a stack or memo entry missing.
    if isinstance(error, (KeyError, IndexError, EOFError, struct.error)) or line.startswith("Unsupported operand"):
        return "not a file written by torch.save"
    return line.split(". ")[0].rstrip(".") or type(error).__name__  # the first sentence: the rest is advice


def _fits(value: Any, kind: Kind) -> bool:
    if kind is StateDict:
        return isinstance(value, dict)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))  # True is no count


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _kind_name(kind: Kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_a("dict of tensors" if k is StateDict else k.__name__) for k in kinds)


def _not_tensors(value: dict) -> str | None:
    """The first entry of a dict that is not a named tensor, in words; None when every entry is one."""
    return next((f"entry {name!r:.40} is {_a(type(entry).__name__)}" for name, entry in value.items()
                 if not isinstance(name, str) or not isinstance(entry, torch.Tensor)), None)


@dataclass(frozen=True)
class TorchFormat:
    """One kind of torch file: what it is called, what to do with a file that cannot be used, and what its
    payload (a dict) holds."""

    what: str  # the kind of file, as messages name it: "relicv2 pretraining checkpoint"
    fix: str  # what to do about a file that cannot be used, ending its messages
    tag: str | None = None  # the payload's "format" entry (None: files of this kind carry none)
    version: int | None = None  # the payload's "version" entry, written and checked (None: carried in no file)
    fields: Mapping[str, Kind] = field(default_factory=dict)  # the required fields and their types
    state_dict: bool = False  # the payload is a plain state dict (no tag, version or fields)
    error: type[TorchFileError] = TorchFileError  # raised for every failure (a subclass callers already catch)

    def fail(self, path: Path, problem: str) -> TorchFileError:
        """The error for a file of this kind that cannot be used: `problem`, then what to do."""
        return self.error(f"{path} {problem}; {self.fix}")

    def read(self, path: str | Path, map_location: str | torch.device = "cpu") -> Any:
        """The unpickled payload of `path`, unchecked (for a format's own look at a foreign file first)."""
        path = Path(path)
        if not path.exists():
            raise self.error(f"{self.what} {path} does not exist; check the path")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except TORCH_LOAD_ERRORS as error:
            raise self.fail(path, f"is not a readable {self.what} ({load_failure(error)})") from None

    def check(self, path: str | Path, payload: Any) -> Any:
        """`payload` (read from `path`) when it is one of this format's; else the error naming the problem."""
        path = Path(path)
        if not isinstance(payload, dict):
            raise self.fail(path, f"is not {_a(self.what)} (it holds {_a(type(payload).__name__)})")
        if self.state_dict:
            problem = _not_tensors(payload)
            if problem:
                raise self.fail(path, f"does not hold a state dict of tensors (its {problem})")
            return payload
        if self.tag is not None and payload.get("format") != self.tag:
            found = payload.get("format")
            held = f"its format is {found!r:.60}" if isinstance(found, str) else f"it holds {sorted(map(str, payload))[:5]}"
            raise self.fail(path, f"is not {_a(self.what)} ({held})")
        found = payload.get("version")
        if self.version is not None and type(found) is int and found > self.version:
            raise self.error(f"{path} is {_a(self.what)} of format version {found}, newer than this relicv2 reads "
                             f"({self.version}); upgrade relicv2 to read it")
        if self.version is not None and found != self.version:
            raise self.fail(path, f"has {self.what} format version {found!r:.20}, this relicv2 reads version {self.version}")
        missing = [name for name in self.fields if name not in payload]
        if missing:
            raise self.fail(path, f"lacks {missing}: it is an incomplete {self.what}")
        for name, kind in self.fields.items():
            value = payload[name]
            if not _fits(value, kind):
                raise self.fail(path, f"is damaged or hand-made: its field {name!r} is {_a(type(value).__name__)}, "
                                      f"{_a(self.what)} holds {_kind_name(kind)} there")
            problem = _not_tensors(value) if kind is StateDict else None
            if problem:
                raise self.fail(path, f"is damaged or hand-made: in its field {name!r}, {problem}, not a tensor")
        return payload

    def load(self, path: str | Path, map_location: str | torch.device = "cpu") -> Any:
        """`read` then `check`: the payload of a file of this format."""
        return self.check(path, self.read(path, map_location))

    @contextlib.contextmanager
    def saving(self, path: str | Path, payload: Mapping[str, Any]) -> Iterator[None]:
        """Write `payload`, tagged, under a temporary name beside `path`; the body runs before it is renamed
        to `path` (to write a companion file first); an exception leaves `path` as it was."""
        missing = [name for name in self.fields if name not in payload]
        if missing:
            raise ValueError(f"{self.what} payload lacks {missing}")
        tags = {"format": self.tag} if self.tag is not None else {}
        if self.version is not None:
            tags["version"] = self.version
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            torch.save({**tags, **payload}, tmp)
            yield

    def save(self, path: str | Path, payload: Mapping[str, Any]) -> Path:
        """Write `payload`, tagged, atomically to `path`; `path`."""
        with self.saving(path, payload):
            pass
        return Path(path)

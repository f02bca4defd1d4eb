"""The one reader and writer of the project's torch files (checkpoints, exported encoders, backbone weights,
saliency models and their work files, feature caches, evaluation state files).

A format is a declaration, `TorchFormat`: its tag, version and required fields with their types. Writing
tags the payload and is atomic (`jobs.atomic`). Reading is `torch.load(weights_only=True)` only: a file may
come from someone else, and nothing in it may run. Every file that cannot be used is one `TorchFileError`,
one line naming the file and what to do, never torch's advice to run the file's code (`weights_only=False`,
allowlisted globals): for a file that is not trusted, that is never the way out.
"""

from __future__ import annotations

import contextlib
import io
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


class _WriteFile(io.FileIO):
    """The file torch writes into, keeping the OSError of a failed write: torch reports a disk that fills
    midway only as "enforce fail at inline_container.cc ... unexpected pos", without the cause."""

    error: OSError | None = None

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as error:
            self.error = error
            raise


class TorchFileError(ValueError):
    """A torch file that cannot be used; the message is one line naming the file and what to do."""


class StateDict:
    """A field's type: a dict of named tensors, as `Module.state_dict()` gives."""


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


def is_state_dict(value: Any) -> bool:
    """A dict of named tensors (what `Module.state_dict()` gives)."""
    return _problem(value, StateDict) is None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _problem(value: Any, kind: type) -> str | None:
    """How `value` falls short of a `kind`, in words ("is a str, not an int"); None when it is one."""
    if not isinstance(value, dict if kind is StateDict else kind) or (isinstance(value, bool) and kind is not bool):
        return f"is {_a(type(value).__name__)}, not {_a('dict of tensors' if kind is StateDict else kind.__name__)}"
    if kind is StateDict:
        return next((f"holds {_a(type(entry).__name__)} at {name!r:.40}, not a tensor" for name, entry in value.items()
                     if not isinstance(name, str) or not isinstance(entry, torch.Tensor)), None)
    return None


@dataclass(frozen=True)
class TorchFormat:
    """One kind of torch file: what it is called, what to do with a file that cannot be used, and what its
    payload (a dict) holds."""

    what: str  # the kind of file, as messages name it: "relicv2 pretraining checkpoint"
    fix: str  # what to do about a file that cannot be used, ending its messages
    tag: str | None = None  # the payload's "format" entry (None: files of this kind carry none)
    version: int | None = None  # the payload's "version" entry, written and checked (None: carried in no file)
    fields: Mapping[str, type] = field(default_factory=dict)  # the required fields and their types (StateDict too)
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
        problem = _problem(payload, StateDict if self.state_dict else dict)
        if problem:
            raise self.fail(path, f"is not {_a(self.what)}: it {problem}")
        found = payload.get("format")
        if self.tag is not None and found != self.tag:
            held = f"its format is {found!r:.60}" if isinstance(found, str) else f"it holds {sorted(map(str, payload))[:5]}"
            raise self.fail(path, f"is not {_a(self.what)} ({held})")
        found = payload.get("version")
        if self.version is not None and found != self.version:
            fix = "upgrade relicv2 to read it" if type(found) is int and found > self.version else self.fix
            raise self.error(f"{path} has {self.what} format version {found!r:.20}, this relicv2 reads version "
                             f"{self.version}; {fix}")
        missing = [name for name in self.fields if name not in payload]
        if missing:
            raise self.fail(path, f"lacks {missing}: it is an incomplete {self.what}")
        for name, kind in self.fields.items():
            problem = _problem(payload[name], kind)
            if problem:
                raise self.fail(path, f"is damaged or hand-made: its field {name!r} {problem}")
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
            with _WriteFile(tmp, "wb") as handle:
                try:
                    torch.save({**tags, **payload}, handle)
                except RuntimeError:
                    if handle.error is None:
                        raise
                    raise OSError(handle.error.errno, handle.error.strerror, str(path)) from None
            yield

    def save(self, path: str | Path, payload: Mapping[str, Any]) -> Path:
        """Write `payload`, tagged, atomically to `path`; `path`."""
        with self.saving(path, payload):
            pass
        return Path(path)

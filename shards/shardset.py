"""Resolving "a shard set" (folder, brace pattern, tar, or list of tars) into tars, index files and counts.

Accepts sets made by `relicv2 shards build` (manifest, `.idx` beside each tar) and plain WebDataset
shards from other tools (webdataset.ShardWriter, `tar`): no manifest, no index, names like
`train-0000.tar` or `imagenet-train-{000000..001281}.tar`. A missing index is derived once from
the tar and kept in a cache folder (default `$RELICV2_INDEX_CACHE` or `~/.cache/relicv2/index`),
named after the tar's absolute path, size and modification time, so a changed tar gets a new one.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.progress import Phase, tracked
from relicv2.jobs.workers import worker_pool
from relicv2.shards.index import derive_index, index_path, read_index, write_refused
from relicv2.shards.manifest import MANIFEST_NAME, is_plain_tar_name, read_manifest
from relicv2.shards.sample import LABEL_MEMBER, MASK_MEMBER

# Shard file names: ours are `{prefix}-NNNNNN.tar`; other tools write 4 or 5 digits too.
SHARD_PATTERN = re.compile(r"[^.].*-\d{4,6}\.tar")
BRACE = re.compile(r"\{([^{}]*)\}")
INDEX_CACHE_ENV = "RELICV2_INDEX_CACHE"


class ShardSetError(ValueError):
    """A shard set spec that names no usable tars, or a set whose files disagree; names the fix."""


@dataclass(frozen=True)
class ShardSet:
    """A shard set resolved once for a job (`resolve_shard_set`): its tars, with one DALI index and sample
    count each (same order). Every function here and in the jobs that takes a spec takes one too.

    manifest: the set's manifest.parquet table when it has one (sets from `shards build`), else None.
    has_labels: whether samples carry a class (`cls` member / manifest label); has_masks: whether any
    carries a saliency mask (`mask.png` member). Prints as the spec it was resolved from. lost: (tar, why)
    of the tars that `resolve_shard_set(allow_lost=True)` could not index, not in `tars`.
    """

    tars: tuple[Path, ...]
    index_files: tuple[Path, ...]
    counts: tuple[int, ...]
    manifest: pa.Table | None
    has_labels: bool
    directory: Path | None = None  # the folder of a folder spec
    has_masks: bool = False
    spec: str = ""
    lost: tuple[tuple[Path, str], ...] = ()

    @property
    def samples(self) -> int:
        return sum(self.counts)

    def __str__(self) -> str:
        return self.spec


def expand_braces(pattern: str) -> list[str]:
    """`train-{0000..0003}.tar` -> 4 names (zero padding kept); `{a,b}` alternatives too."""
    parts = BRACE.split(pattern)
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
            continue
        if match := re.fullmatch(r"(\d+)\.\.(\d+)", part):
            lo, hi = match.groups()
            if int(hi) < int(lo):
                raise ShardSetError(f"brace range {{{part}}} in {pattern!r} runs backwards")
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            choices.append([str(n).zfill(width) for n in range(int(lo), int(hi) + 1)])
        elif "," in part:
            choices.append(part.split(","))
        else:
            raise ShardSetError(f"{{{part}}} in {pattern!r} is neither a range {{000..099}} nor a list {{a,b}}")
    return ["".join(c) for c in itertools.product(*choices)]


def list_shard_files(directory: Path) -> list[Path]:
    """The shard tars of a folder by name (`*-NNNN.tar` .. `*-NNNNNN.tar`), sorted; symlinked files included."""
    return sorted(p for p in Path(directory).iterdir() if SHARD_PATTERN.fullmatch(p.name) and p.is_file())


Spec = str | Path | Sequence[str | Path] | ShardSet  # what names a shard set


def shard_tars(spec: Spec) -> tuple[list[Path], Path | None]:
    """(tar paths, the folder when `spec` is one) for a folder, a tar, a brace pattern, a list or a resolved
    set. Every name is a local file, never a URL (`pipe:` is a file name here)."""
    if isinstance(spec, ShardSet):  # the tars a resolution lost first, where they exist: what remains is read
        return [*(tar for tar, _ in spec.lost if tar.is_file()), *spec.tars], spec.directory
    if isinstance(spec, str | Path):
        text = str(spec)
        path = Path(text)
        if path.is_dir():
            tars = list_shard_files(path)
            if not tars:
                raise ShardSetError(
                    f"no shards (*-NNNNNN.tar, 4-6 digits) in {path}; build them with relicv2 shards build"
                )
            return tars, path
        if not BRACE.search(text) and not path.exists():
            raise ShardSetError(f"{path} does not exist; give a shard set folder, a brace pattern "
                                "(name-{0000..0099}.tar) or a tar file")
        names = expand_braces(text) if BRACE.search(text) and not path.is_file() else [text]
    else:
        names = [str(p) for p in spec]
        if not names:
            raise ShardSetError("the list of shards is empty; give a folder, a brace pattern or tar files")
    tars = [Path(n) for n in names]
    if missing := [t for t in tars if not t.is_file()]:
        shown = ", ".join(str(m) for m in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ShardSetError(f"shard file(s) not found: {shown}; check the path or pattern")
    return tars, None


def default_index_cache(given: str | Path | None = None) -> Path:
    """Where derived index files (and the view loaders' sample checks) go: `given`, else the default."""
    if given is not None:
        return Path(given)
    if env := os.environ.get(INDEX_CACHE_ENV):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relicv2" / "index"


def file_identity(path: Path) -> str:
    """A file's absolute path, size and modification time: what names the cache entries derived
    from it, so that a changed file gets new ones."""
    stat = path.stat()
    return f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"


def cache_name(tar: Path, *extra: str) -> str:
    """The stem of a cache entry derived from `tar` (and whatever else `extra` names)."""
    ident = "\0".join([file_identity(tar), *extra])
    return f"{tar.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cached_index_path(tar: Path, cache: Path) -> Path:
    """Where the derived index of `tar` lives in `cache` (named after its path, size and mtime; "refused
    kept": from the version that keeps the members refused beside it, so older ones are derived again)."""
    return cache / f"{cache_name(tar, 'refused kept')}.idx"


def tar_index(tar: Path, cache: Path) -> Path:
    """The index of `tar`: the one beside it, else the one derived into `cache` (written on first use, after
    the members its derivation refused, which the reader reports: `shards.index.read_refused`)."""
    if index_path(tar).is_file():
        return index_path(tar)
    path = cached_index_path(tar, cache)
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        text, refused = derive_index(tar)
        write_refused(path, refused)
        atomic_write_bytes(path, text.encode("utf-8"))
    return path


def needs_index(tar: Path, cache: Path) -> bool:
    """True when `tar` has no index beside it and none derived in `cache` yet."""
    return not index_path(tar).is_file() and not cached_index_path(tar, cache).is_file()


@dataclass(frozen=True)
class Derived:
    """What `derive_missing_indexes` did: index files written, tars in the set, unreadable tars."""

    written: int
    tars: int
    failed: dict[Path, str]  # tar -> why no index could be derived (one line naming the fix)


def in_workers(fn: Callable, items: Sequence, *more: Sequence, workers: int, desc: str, unit: str = "shard",
               enabled: bool = True) -> list:
    """`fn` over `items` (zipped with `more`) in order, in up to `workers` processes, with progress."""
    if workers <= 1 or len(items) <= 1:
        return list(tracked(map(fn, items, *more), desc, len(items), unit=unit, enabled=enabled))
    with worker_pool(min(workers, len(items))) as pool:
        return list(tracked(pool.map(fn, items, *more), desc, len(items), unit=unit, enabled=enabled))


def _derive(tar: Path, cache: Path) -> str | None:
    """Write the derived index of `tar`; the reason when the tar cannot be read (a bad tar is
    reported with the others, not the end of the job)."""
    try:
        tar_index(tar, cache)
    except ValueError as exc:
        return str(exc)
    return None


def derive_missing_indexes(
    spec: Spec, *, index_cache: Path | None = None, part: tuple[int, int] = (0, 1),
    workers: int = 1, progress: bool = True,
) -> Derived:
    """Derive the missing indexes of part `index` of `parts` of the set's tars (every parts-th tar), in
    `workers` processes. The ranks of a job each call it with their own part before a barrier, so a plain
    set's tars are read once between them instead of once per rank (with the cache on a shared filesystem).
    An unreadable spec raises ShardSetError, an unwritable cache OSError; unreadable tars are listed."""
    index, parts = part
    tars, _ = shard_tars(spec)
    cache = default_index_cache(index_cache)
    missing = [tar for i, tar in enumerate(tars) if i % parts == index and needs_index(tar, cache)]
    desc = f"index files of {len(tars)} tars" + (f" (part {index + 1}/{parts})" if parts > 1 else "")
    reasons = in_workers(functools.partial(_derive, cache=cache), missing, workers=workers, desc=desc,
                         unit="tar", enabled=progress and bool(missing))
    failed = {tar: reason for tar, reason in zip(missing, reasons, strict=True) if reason is not None}
    return Derived(len(missing) - len(failed), len(tars), failed)


def listed_shards(directory: Path, manifest: pa.Table | None = None, *, allow_lost: bool = False
                  ) -> tuple[dict[Path, int], list[tuple[Path, str]]]:
    """The tars the manifest of `directory` lists, in name order, each with its sample count, and (tar,
    why) of those missing (ShardSetError for any unless `allow_lost`). Reads only the manifest's shard
    column unless given the table. ShardSetError for an unreadable manifest or one naming anything but
    a shard file of the folder."""
    path = directory / MANIFEST_NAME
    try:
        names = manifest.schema.names if manifest is not None else pq.read_schema(path).names
        if "shard" not in names:
            raise ShardSetError(f"{path} has no 'shard' column; it is not a relicv2 manifest")
        column = manifest.column("shard") if manifest is not None else pq.read_table(path, columns=["shard"]).column(0)
    except (OSError, pa.ArrowException) as exc:
        raise ShardSetError(f"{path} cannot be read ({exc}); rebuild the shard set") from None
    # Counted in Arrow: a Python string a row was a second's CPU on every rank at ImageNet's size.
    counted = pc.value_counts(column)
    per_name = dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True))
    listed = sorted(per_name, key=str)
    unsafe = [n for n in listed if not is_plain_tar_name(n) or not SHARD_PATTERN.fullmatch(n)]
    if unsafe:
        raise ShardSetError(f"{path} names {unsafe[0]!r}, not a shard file of this folder; rebuild the set")
    tars = {directory / name: per_name[name] for name in listed}
    lost = [(t, "listed in the manifest but missing") for t in tars if not t.is_file()]
    if lost and not allow_lost:
        raise ShardSetError(f"{directory}: the manifest lists {', '.join(t.name for t, _ in lost[:3])}, which is "
                            "missing; rebuild the set")
    return tars, lost


def check_count(tar: Path, count: int, listed: int, *, allow_lost: bool = False) -> None:
    """ShardSetError unless `tar`'s index lists the `listed` samples its manifest does (or, with
    `allow_lost`, fewer: a tar cut short)."""
    if listed != count and not (allow_lost and count < listed):
        raise ShardSetError(
            f"{tar}: the index lists {count} samples, the manifest {listed}; the set is incomplete or mixed: "
            "rebuild it (relicv2 shards build) or run relicv2 shards verify"
        )


def resolve_shard_set(spec: Spec, *, index_cache: Path | None = None, allow_lost: bool = False) -> ShardSet:
    """A shard set spec -> tars + index files + sample counts (+ manifest when the folder has one); a
    resolved set is returned as it is. With a manifest, the tars are exactly the manifest's shards and
    each index must agree with it; without one, every `*-NNNN(NN).tar` is used and missing indexes are
    derived into `index_cache`. Raises ShardSetError (a ValueError) naming the file and the fix; with
    `allow_lost` a tar missing or not indexable goes to `ShardSet.lost`, one short of the manifest stays
    (`shards.iter_samples` reads both)."""
    if isinstance(spec, ShardSet):
        return spec
    tars, directory = shard_tars(spec)
    manifest, lost = None, []
    if directory is not None and (directory / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(directory)
        except (OSError, pa.ArrowException) as exc:
            raise ShardSetError(f"{directory / MANIFEST_NAME} cannot be read ({exc}); rebuild the shard set") from None
        listed, lost = listed_shards(directory, manifest, allow_lost=allow_lost)
        tars = [t for t in listed if t.is_file()]
    cache = default_index_cache(index_cache)
    kept, index_files, counts, extensions = [], [], [], set()
    missing = {tar for tar in tars if needs_index(tar, cache)}  # each read whole once: show progress
    phase = Phase(f"index files of {len(tars)} tars", len(missing), unit="tar", enabled=bool(missing))
    for tar in tars:
        try:
            idx = tar_index(tar, cache)
            if tar in missing:
                phase.update()
            samples = read_index(idx, tar)
        except ValueError as exc:
            if not allow_lost:
                raise ShardSetError(str(exc)) from None
            lost.append((tar, str(exc)))
            continue
        except OSError as exc:
            raise ShardSetError(
                f"cannot write the index of {tar} into {cache} ({exc.strerror or exc}); "
                f"choose a writable index cache (index_cache= or ${INDEX_CACHE_ENV})"
            ) from None
        kept.append(tar)
        index_files.append(idx)
        counts.append(len(samples))
        extensions |= {e[0] for s in samples for e in s}
    phase.close()
    labelled = LABEL_MEMBER in extensions
    if manifest is not None:
        for tar, count in zip(kept, counts, strict=True):
            check_count(tar, count, listed[tar], allow_lost=allow_lost)
        if "label" in manifest.column_names:
            labelled = manifest.column("label").null_count < manifest.num_rows
    text = str(spec) if isinstance(spec, str | Path) else " ".join(str(s) for s in spec)
    return ShardSet(tuple(kept), tuple(index_files), tuple(counts), manifest, labelled, directory,
                    MASK_MEMBER in extensions, text, tuple(lost))

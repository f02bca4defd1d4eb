"""The shard-job engine's units and done records: what a rerun checks (`pending_reason`), the wait for every
rank's records (`wait_for_records`) and their merge into manifest.parquet, rejected.parquet and info.json
(`merge_records`). docs/design.md ("One of each piece of machinery") gives the sequence; `shards.driver`
runs it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relicv2.jobs.atomic import OutputError, atomic_write_bytes
from relicv2.jobs.progress import Phase
from relicv2.shards.index import index_path
from relicv2.shards.keys import UnsafeKeyError, check_key
from relicv2.shards.manifest import (
    MANIFEST_NAME,
    REJECTED_NAME,
    concat_manifests,
    manifest_table,
    rejected_table,
    write_table,
)
from relicv2.shards.writer import TarShard, shard_name, write_info

POLL_S = 2.0
PLAN_NAME = "plan.json"  # in the work folder: what the job's outputs are made from (the folder's claim)
RECORD_SUFFIX = ".done.json"
RECORD_FIELDS = {"shard", "digest", "empty", "manifest", "rejected"}
NOT_DONE = "not built yet"
INPUT_CHECKS = ("time", "content")  # how a rerun tells a changed input file (`input_files_identity`)


class PlanError(ValueError):
    """The work folder holds the plan of another job, or a plan that cannot be read: names the file."""


class UnfinishedError(RuntimeError):
    """Units whose done record is missing or stale when the job merges: names them and the way out."""


@dataclass(frozen=True)
class Unit:
    """One unit of a shard job: `id` names its done record, `shard` is its output tar's file name,
    `digest` covers everything the unit's output is made from."""

    id: str
    shard: str
    digest: str


@dataclass(frozen=True)
class ShardJob:
    """A planned shard job: its output folder, its hidden work folder (plan, done records), its units."""

    out: Path
    work: Path
    units: tuple[Unit, ...]
    classes: int = 0  # the class count labels must stay below (0: not known, any class index)

    @property
    def plan_path(self) -> Path:
        """The job's plan record: what its outputs are made from."""
        return self.work / PLAN_NAME

    def record_path(self, unit: Unit) -> Path:
        return self.work / f"{unit.id}{RECORD_SUFFIX}"


def tar_job(out: Path, work: str, tars: Sequence[Path], prefix: str, settings: dict) -> ShardJob:
    """A job of one unit per input tar: unit N writes `PREFIX-NNNNNN.tar` in `out` from `tars[N]`, its records
    in `out/work`. A unit's digest covers `settings` (what makes other outputs from the same input), its output
    name and its input tar's name, size and modification time: a stat, so any rank can check any unit's
    record (a unit's owner checks more, through `input_tar_identity`)."""
    units = []
    for number, tar in enumerate(tars):
        stat, shard = tar.stat(), shard_name(prefix, number)
        digest = digest_of({**settings, "shard": shard, "input": tar.name, "bytes": stat.st_size,
                            "mtime_ns": stat.st_mtime_ns})
        units.append(Unit(f"{number:06d}", shard, digest))
    return ShardJob(out, out / work, tuple(units))


def rank_units(count: int, rank: int, world_size: int) -> range:
    """The contiguous unit numbers rank `rank` of `world_size` does; the ranks cover all, disjointly."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return range(count * rank // world_size, count * (rank + 1) // world_size)


def check_plan(job: ShardJob, plan: dict, *, other: str) -> None:
    """Refuse (PlanError) a work folder holding another job's plan (`other` says what the folder then
    holds) or an unreadable one; none yet, or this one (a run to resume), pass. Reads only."""
    path = job.plan_path
    if not path.is_file():
        return
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path} cannot be read ({exc}); delete {job.work} to start {job.out} over, "
                        "or choose another --out") from None
    if held != plan:
        raise PlanError(f"{job.out} holds {other}; choose another --out or delete it")


def write_plan(job: ShardJob, plan: dict) -> None:
    """Claim the output folder for this plan, before any output (every rank may: same bytes, atomic)."""
    job.work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(job.plan_path, (json.dumps(plan, indent=1, sort_keys=True) + "\n").encode())


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_of(content: object) -> str:
    """SHA-256 of a JSON-able description (keys sorted)."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()


def input_tar_identity(tar: Path, index: Path) -> dict:
    """What identifies an input tar cheaply: its size and modification time, and the SHA-256 of its
    (small) index. A tar rewritten under the same name changes at least its time; no tar is read."""
    stat = tar.stat()
    return {"tar": tar.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "index_sha256": sha256_of(index)}


def input_files_identity(files: Sequence[tuple[str, int]], check: str = "time") -> dict:
    """What a done record keeps of a unit's input files, (path, modification time in ns) each, so that a
    rerun tells a changed one (`pending_reason`). "time": their times (their sizes are in the unit's
    digest): an edit that keeps a file's size still changes its time, as make and ninja rely on; free, the
    listing stat()ed them. "content": the SHA-256 of their bytes, for file systems whose times cannot be
    trusted; it reads every input on every run (`benchmarks/bench_input_check.py`)."""
    if check == "content":
        return {"inputs_sha256": digest_of([sha256_of(Path(path)) for path, _ in files])}
    return {"inputs_mtime_ns": digest_of([mtime for _, mtime in files])}


def load_record(job: ShardJob, unit: Unit) -> dict | str:
    """The done record of `unit`, checked like any file a user could have edited (its fields, its shard,
    each manifest row's key (safe), shard and label (a class index, below `job.classes` when known) and
    each rejected row), or why there is none to use: NOT_DONE, or what is wrong with the file."""
    path = job.record_path(unit)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return NOT_DONE
    except OSError as exc:
        return f"its done record {path.name} cannot be read ({exc.strerror or exc})"
    except (ValueError, RecursionError) as exc:
        return f"its done record {path.name} is not valid (it is not JSON ({str(exc)[:80]}))"
    problem = _record_problem(record, unit, job.classes)
    return record if problem is None else f"its done record {path.name} is not valid ({problem})"


def _record_problem(record: object, unit: Unit, classes: int) -> str | None:
    if not isinstance(record, dict) or not RECORD_FIELDS <= set(record):
        return "fields are missing"
    if record["shard"] != unit.shard or not isinstance(record["empty"], bool) \
            or not isinstance(record["manifest"], list) or not isinstance(record["rejected"], list):
        return f"it names shard {str(record['shard'])[:80]!r} or its fields have other types"
    for row in record["manifest"]:
        if not isinstance(row, dict) or row.get("shard") != unit.shard:
            return f"a manifest row is not one of {unit.shard}"
        try:
            check_key(row.get("key"))
        except UnsafeKeyError as exc:
            return f"a manifest row's {exc}"
        label = row.get("label")
        if label is not None and (type(label) is not int or (classes and not 0 <= label < classes)):
            limit = f" of the set's {classes} classes" if classes else ""
            return f"sample {row['key']!r} has label {str(label)[:20]}, not a class index{limit}"
    if not all(isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("source", "reason"))
               for row in record["rejected"]):
        return "a rejected row is not a source with a reason"
    return None


def pending_reason(job: ShardJob, unit: Unit, inputs: dict | None = None, rehash: bool = False) -> str | None:
    """None when the unit is finished: its record is there, made from these inputs (`unit.digest`,
    and `inputs` when the job checks more than the digest), and its files are those it records
    (with `rehash`, hashed: see `files_changed`). Otherwise why the unit must be (re)done: NOT_DONE,
    or what changed since it was done."""
    record = load_record(job, unit)
    if isinstance(record, str):
        return record
    if record["digest"] != unit.digest:
        return "its inputs changed since it was built"
    if inputs is not None and record.get("inputs") != inputs:
        if not isinstance(record.get("inputs"), dict) or set(record["inputs"]) != set(inputs):
            return "its done record does not identify its inputs this way (made by an older version or another check)"
        return "an input changed since it was built"
    if record["empty"]:
        return f"its tar {unit.shard} exists, but it had no sample when it was built" \
            if (job.out / unit.shard).exists() else None
    return files_changed(job.out / unit.shard, record, job.record_path(unit), rehash)


def files_changed(tar: Path, record: dict, marker: Path, rehash: bool = False) -> str | None:
    """What differs between a finished unit's tar and index and its done record, or None.

    The index (small) is hashed on every check. The tar is compared by size; it is hashed only when
    its modification time is not the recorded one, so rerunning a finished job of any size costs
    no read of its tars, while any write to a tar (in place, truncation, a copy) is caught. A
    confirmed tar's new time is recorded, so a copied set is hashed once. Damage that keeps both
    size and time (bit rot on disk) is found with `rehash`: every tar is hashed (`--rehash-shards`).
    """
    idx = index_path(tar)
    for what, path in (("tar", tar), ("index", idx)):
        if not path.is_file():
            return f"its {what} {path.name} is missing"
    if "tar_sha256" not in record:
        # A record written before files were recorded: only presence can be checked. Such sets are
        # kept as they are (not rebuilt wholesale); delete a damaged tar to have it rebuilt.
        return None
    stat = tar.stat()
    if stat.st_size != record.get("tar_bytes"):  # .get: a hand-edited record is a mismatch, not a crash
        return f"its tar has {stat.st_size} bytes, {record.get('tar_bytes')} when it was built"
    if sha256_of(idx) != record.get("index_sha256"):
        return f"its index {idx.name} differs from the one written with it"
    if rehash or stat.st_mtime_ns != record.get("tar_mtime_ns"):
        if sha256_of(tar) != record["tar_sha256"]:
            return "its tar was changed after it was built (its SHA-256 differs)"
        if stat.st_mtime_ns == record.get("tar_mtime_ns"):
            return None
        atomic_write_bytes(marker, json.dumps({**record, "tar_mtime_ns": stat.st_mtime_ns}, sort_keys=True).encode())
    return None


def write_record(job: ShardJob, unit: Unit, shard: TarShard | None, rejected: list[dict],
                 inputs: dict | None = None, extra: dict | None = None) -> dict:
    """The unit's done record, written last (atomically) once its tar is closed (None: nothing written);
    `extra`: what else the job keeps per unit for its summary."""
    record = {**(extra or {}), "shard": unit.shard, "digest": unit.digest, "empty": shard is None,
              "manifest": [] if shard is None else shard.rows, "rejected": rejected}
    if inputs is not None:
        record["inputs"] = inputs
    if shard is not None:  # the identity of its files (their SHA-256 computed while writing)
        stat = shard.path.stat()
        record |= {"tar_bytes": stat.st_size, "tar_mtime_ns": stat.st_mtime_ns, "tar_sha256": shard.sha256,
                   "index_sha256": shard.index_sha256}
    else:  # a redone unit that now writes nothing: the tar an earlier run made from other inputs goes
        for stale in (job.out / unit.shard, index_path(job.out / unit.shard)):
            stale.unlink(missing_ok=True)
    job.work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(job.record_path(unit), json.dumps(record, sort_keys=True).encode())
    return record


def wait_for_records(job: ShardJob, wait_s: float, *, progress: bool = True, rerun: str = "rerun the job") -> list[dict]:
    """Every unit's record, made from the unit's current inputs (its manifest rows as a table), waiting
    up to `wait_s` seconds for the other ranks; raises UnfinishedError naming the units still missing or
    stale and the way out."""
    deadline = time.monotonic() + wait_s
    found: dict[str, dict] = {}
    problems: dict[str, str] = {}  # the units whose record is there but cannot be used: why
    waiting = list(job.units)
    with Phase("merge: reading done records", len(job.units), unit="shard", enabled=progress) as bar:
        while True:
            for unit in waiting:
                record = load_record(job, unit)
                if isinstance(record, str):  # missing, or not valid
                    problems[unit.id] = record
                elif record["digest"] == unit.digest:  # else from other inputs
                    # Columns now, not a dict a row: 1.28 M rows as dicts held 3 GB in the merge.
                    found[unit.id] = {**record, "manifest": manifest_table(record["manifest"])}
                    bar.update(1)
            waiting = [u for u in waiting if u.id not in found]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    if waiting:
        shown = ", ".join(u.shard for u in waiting[:5]) + (" ..." if len(waiting) > 5 else "")
        if invalid := [f"{u.shard}: {problems[u.id]}" for u in waiting if problems.get(u.id, NOT_DONE) != NOT_DONE]:
            shown += f"; {invalid[0]}" + (f" (and {len(invalid) - 1} more)" if len(invalid) > 1 else "")
        raise UnfinishedError(
            f"{len(waiting)} shard(s) of {job.out} are not finished from the current inputs ({shown}); {rerun}"
        )
    return [found[u.id] for u in job.units]


@dataclass(frozen=True)
class MergeReport:
    """Totals of a merged shard set."""

    shards: int
    written: int
    rejected: int
    rejected_by_reason: dict[str, int]
    empty_shards: list[str]


def merge_records(out: Path, records: Sequence[dict], info: dict, rejected: Sequence[dict] = ()) -> MergeReport:
    """Write the set's manifest.parquet, rejected.parquet (the records' rejections plus `rejected`,
    sorted) and info.json (the totals, then the job's own `info`) from the units' done records (as
    `wait_for_records` gives them: each manifest a table)."""
    manifest = concat_manifests([r["manifest"] for r in records])
    listed = sorted([*rejected, *(row for r in records for row in r["rejected"])],
                    key=lambda r: (r["source"], r["reason"]))
    write_table(manifest, out / MANIFEST_NAME)
    write_table(rejected_table(listed), out / REJECTED_NAME)
    by_reason = dict(sorted(Counter(r["reason"] for r in listed).items()))
    sizes = [r["tar_bytes"] if "tar_bytes" in r else (out / r["shard"]).stat().st_size
             for r in records if not r["empty"]]
    empty = [r["shard"] for r in records if r["empty"]]
    write_info(out, {
        "shards": len(sizes),
        "empty_shards": empty,
        "samples": manifest.num_rows,
        "labelled": manifest.num_rows - manifest.column("label").null_count,
        "rejected": len(listed),
        "rejected_by_reason": by_reason,
        "bytes": sum(sizes),
        "shard_bytes": {"min": min(sizes, default=0), "max": max(sizes, default=0)},
        **info,
    })
    return MergeReport(len(sizes), manifest.num_rows, len(listed), by_reason, empty)


def output_error(exc: OSError, out: Path, option: str = "--out") -> OutputError:
    """An OSError while writing -> one sentence naming the path, the cause and the way out."""
    path = exc.filename or out
    cause = exc.strerror or str(exc)
    hint = {
        errno.ENOSPC: f"free space on that file system or choose another {option}",
        errno.EDQUOT: f"free space (quota) or choose another {option}",
        errno.EFBIG: f"free space (or raise the file size limit) or choose another {option}",
        errno.EROFS: f"the file system is read-only; choose another {option}",
        errno.EACCES: f"you may not write there; choose another {option} or fix its permissions",
        errno.EPERM: f"you may not write there; choose another {option} or fix its permissions",
        errno.ENOTDIR: f"a part of that path is a file; choose another {option}",
    }.get(exc.errno, "check the output folder")
    return OutputError(
        f"cannot write {path}: {cause}; {hint} (finished shards are kept: rerun the same command to resume)"
    )

"""Which files of an output folder belong to a build, claiming a folder for a new one, and the check
every job makes of its output paths before it works. A build deletes only files its own plan or manifest
lists (a job never deletes what it did not write): anything else in the folder is refused, and
`--overwrite` removes only a previous build's own files.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from relicv2.jobs.atomic import OutputError
from relicv2.shards.index import shard_files
from relicv2.shards.job import ShardJob, write_plan
from relicv2.shards.manifest import MANIFEST_NAME, REJECTED_NAME, manifest_shards
from relicv2.shards.merge import plan_file, read_plan, work_dir
from relicv2.shards.sources import InputError

INFO_NAME = "info.json"
SET_FILES = (MANIFEST_NAME, REJECTED_NAME, INFO_NAME)
CORRUPT = object()  # a plan.json that cannot be read


def check_output_folder(folder: Path, option: str) -> None:
    """Refuse, before any work, an output folder the job could not create or write into: a file at its
    place or above it, or a folder (its own or its nearest existing parent) this user may not write."""
    folder = Path(folder)
    absolute = folder.absolute()
    existing = next(p for p in (absolute, *absolute.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        where = "is a file" if existing == absolute else f"lies under {existing}, which is a file"
        raise OutputError(f"{option} {folder} {where}, not a folder; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {folder}: {existing} is not writable (read-only, or another user's); "
                          f"choose another {option}")


def check_output_file(path: Path, option: str) -> None:
    """Refuse, before any work, an output file the job could not write (see `check_output_folder`)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path} is a folder; give the path of the file to write")
    check_output_folder(path.parent, option)


@contextlib.contextmanager
def writing(path: Path, option: str, errors: tuple[type[Exception], ...] = (OSError,)) -> Iterator[None]:
    """Turn a failed write inside the block (a full disk, a file system gone read-only) into one
    OutputError naming `path`. `errors`: what the writer raises (torch.save raises RuntimeError)."""
    try:
        yield
    except errors as error:
        detail = error.strerror if isinstance(error, OSError) and error.strerror else "the write failed; is the disk full?"
        raise OutputError(f"cannot write {option} {path}: {detail}; free some space or choose another {option}") from None


def previous_plan(out: Path) -> dict | None | object:
    """The plan of the build in `out`: a dict, None when there is none, CORRUPT when unusable."""
    try:
        return read_plan(out)
    except ValueError:
        return CORRUPT


def own_files(out: Path, plan: dict | None | object) -> set[str]:
    """Names in `out` a previous build (its plan, else its manifest) wrote; never anything else."""
    if isinstance(plan, dict):
        return shard_files([s["name"] for s in plan["shards"]]) | set(SET_FILES)
    names = manifest_shards(out)
    if names is None:  # none, or a broken one: still ours to replace, its shards unknown
        return {MANIFEST_NAME} if (out / MANIFEST_NAME).is_file() else set()
    return shard_files(sorted(names)) | set(SET_FILES)


def other_entries(out: Path, ours: set[str]) -> list[str]:
    """Visible entries of `out` that are not in `ours`."""
    if not out.is_dir():
        return []
    return sorted(
        p.name for p in out.iterdir()
        # Hidden entries (the lock, the work folder, temporaries, a user's dot-files) never clash with outputs.
        if p.name not in ours and not p.name.startswith(".")
    )


def plan_differences(previous: dict, record: dict) -> str:
    """What differs between the plan a folder holds and this build's, e.g. 'max_count: 50 there, 40 now'."""
    def shown(settings: dict, name: str) -> str:
        # A setting missing from a plan is at its default (settings_of leaves some out then).
        return "default" if name not in settings else "none" if settings[name] is None else str(settings[name])

    old = previous.get("settings") if isinstance(previous.get("settings"), dict) else {}
    new = record["settings"]
    found = [f"{name}: {shown(old, name)} there, {shown(new, name)} now"
             for name in sorted(set(old) | set(new)) if old.get(name, ...) != new.get(name, ...)]
    if previous.get("layout") != record["layout"]:
        found.append(f"layout: {previous.get('layout')} there, {record['layout']} now")
    if previous.get("inputs") != record["inputs"]:
        found.append(f"input files: {previous.get('inputs')} there, {record['inputs']} now")
    elif previous.get("classes") != record["classes"]:
        found.append("class folders: other names")
    if not found and previous.get("version") != record["version"]:
        found.append(f"made by relicv2 {previous.get('version')}, this is {record['version']}")
    return "; ".join(found) or "the same number of input files, but a file's name, size or label changed"


def claim_out_dir(out: Path, record: dict, *, overwrite: bool, multi_rank: bool) -> list[str]:
    """Make `out` hold only this build (or an unfinished run of it) and write its plan; return the names of
    the files removed. InputError names the folder, what it holds and the way out, before any removal."""
    planned = shard_files([s["name"] for s in record["shards"]]) | set(SET_FILES)
    previous = previous_plan(out)
    if previous is None and multi_rank and other_entries(out, set()):
        # Another rank may have planned (and started writing) just now: look again once settled.
        previous = previous_plan(out)
    resume = isinstance(previous, dict) and previous["digest"] == record["digest"]
    previous_files = planned if resume else own_files(out, previous)
    existing = {p.name for p in out.iterdir()} if out.is_dir() else set()
    others = other_entries(out, previous_files)
    stale = previous is not None and not resume  # another plan, or an unreadable one
    unknown = previous is None and bool(previous_files & existing)  # a set with a manifest but no plan
    if (stale or unknown or others) and not overwrite:
        if previous is CORRUPT:
            what = f"an unreadable build plan ({plan_file(out)})"
        elif stale:
            what = f"a build of other inputs or settings ({plan_differences(previous, record)})"
        elif unknown:
            what = "a shard set this command did not plan"
        else:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            what = f"files no build wrote ({shown})"
        raise InputError(f"{out} already holds {what}; choose a new --out folder or pass --overwrite")
    collides = re.compile(re.escape(record["settings"]["prefix"]) + r"-\d+\.(tar|idx)")
    # Every refusal before anything is removed: --overwrite never deletes a build and then refuses.
    if clash := [n for n in others if n in planned or collides.fullmatch(n)]:
        raise InputError(
            f"{out} holds {', '.join(clash[:3])}, which this build would overwrite and no build of this "
            "folder wrote; move them away or choose a new --out folder"
        )
    if (stale or unknown) and multi_rank:
        raise InputError(f"--overwrite is not supported under torchrun; empty {out} before the build")
    removed = []
    if stale or unknown:  # with --overwrite: remove the previous build's own files, nothing else
        for name in sorted(previous_files & existing):
            path = out / name
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(name)
        shutil.rmtree(work_dir(out), ignore_errors=True)
    write_plan(ShardJob(out, work_dir(out), ()), record)
    return removed


@contextlib.contextmanager
def output_folder(folder: Path) -> Iterator[None]:
    """Create `folder` (and missing parents) for the block; when the block fails, remove the folders
    it created that are still empty, so a refused job (a build without inputs, a pretraining run
    refused at start) leaves nothing behind."""
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for path in created:
            try:
                path.rmdir()
            except OSError:  # not empty (the job wrote something: kept for the rerun) or already gone
                break
        raise

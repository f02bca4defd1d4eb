"""`shards build`'s side of the job engine: its work folder, plan file and units, and its merge.

Rank 0 merges at the end of `relicv2 shards build` (the engine's driver waits for the other ranks' done
records), or `relicv2 shards merge DIR` does once every rank has finished.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pyarrow.parquet as pq

from relicv2.shards.job import (
    PLAN_NAME,
    MergeReport,
    ShardJob,
    Unit,
    merge_records,
    wait_for_records,
)
from relicv2.shards.manifest import is_plain_tar_name

WORK_DIR = ".build"
PLAN_REJECTED = "plan-rejected.parquet"  # in the work folder: the inputs rejected while listing
PLAN_FIELDS = {"digest", "shards", "settings", "inputs", "classes"}  # what merging a build needs


def work_dir(out: Path) -> Path:
    """The hidden folder holding a build's plan and done records."""
    return Path(out) / WORK_DIR


def plan_file(out: Path) -> Path:
    return work_dir(out) / PLAN_NAME


def read_plan(out: Path) -> dict | None:
    """The plan of the build in `out`, None when it has none; ValueError saying why one is unusable."""
    path = plan_file(out)
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if not isinstance(plan, dict) or not PLAN_FIELDS <= set(plan) or not isinstance(plan["shards"], list):
        raise ValueError("fields missing")
    # A name with a slash or '..' must never reach unlink().
    if not all(isinstance(s, dict) and is_plain_tar_name(s.get("name")) and isinstance(s.get("digest"), str)
               for s in plan["shards"]):
        raise ValueError("a shard entry is not a plain .tar name with a digest")
    return plan


def build_job(out: Path, shards: list[tuple[str, str]], plan: dict) -> ShardJob:
    """The engine's job of a build from its planned shards' (name, digest): the record of a shard is
    named after its digest too, so a record of another plan is never taken for this one's. A set of
    class folders holds labels below its class count (a file list's labels are its own)."""
    units = tuple(Unit(f"{name}.{digest[:16]}", name, digest) for name, digest in shards)
    classes = len(plan["classes"]) if plan.get("layout") == "classes" else 0
    return ShardJob(Path(out), work_dir(out), units, classes)


def rejected_listing_command(path: Path) -> str:
    """A shell line that prints a rejected.parquet one file per line (pyarrow only: pandas is not installed)."""
    code = f"import pyarrow.parquet as pq; print(*pq.read_table({json.dumps(str(path))}).to_pylist(), sep=chr(10))"
    return shlex.join(["python", "-c", code])


def unfinished_hint(out: Path) -> str:
    """The way out when a build's units are unfinished at its merge."""
    return f"rerun the build for the ranks that own them, then run: relicv2 shards merge {out}"


def merge_build(out: Path, plan: dict, records: list[dict]) -> MergeReport:
    """Write a build's manifest, rejections (the plan's and the shards') and info from its plan and every
    shard's done record (as `wait_for_records` gives them)."""
    plan_rejected = pq.read_table(work_dir(out) / PLAN_REJECTED).to_pylist()
    converted = sum(r["manifest"].column("status").to_pylist().count("converted") for r in records)
    return merge_records(out, records, rejected=plan_rejected, info={
        **{name: plan[name] for name in ("inputs", "classes", "layout", "settings", "command", "version")},
        "prefix": plan["settings"]["prefix"],
        "converted": converted,
        "num_classes": len(plan["classes"]),
        "plan_digest": plan["digest"],
        # The output folder as the command names it (`shards verify` names the folder it checks instead).
        **({"out": plan.get("out")} if plan.get("command") else {}),
    })


def merge_shard_set(out: Path, *, wait_s: float = 0.0, progress: bool = True) -> MergeReport:
    """Merge the done records of a planned build into the shard set's manifest, rejections and info;
    the caller holds the folder's lock (the `shards merge` command)."""
    out = Path(out)
    try:
        plan = read_plan(out)
    except ValueError as exc:
        raise RuntimeError(
            f"{plan_file(out)} is not a readable build plan ({exc}); rerun relicv2 shards build with --overwrite"
        ) from None
    if plan is None:
        raise FileNotFoundError(f"{out} holds no build plan ({plan_file(out)}); run relicv2 shards build first")
    job = build_job(out, [(s["name"], s["digest"]) for s in plan["shards"]], plan)
    return merge_build(out, plan, wait_for_records(job, wait_s, progress=progress, rerun=unfinished_hint(out)))

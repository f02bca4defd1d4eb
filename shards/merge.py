"""`shards build`'s side of the job engine: its work folder, plan file and units, and its merge.

Rank 0 merges at the end of `relicv2 shards build` (it waits for the other ranks' done records), or
`relicv2 shards merge DIR` does once every rank has finished (shards.job does the waiting and merging).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pyarrow.parquet as pq

from shards.job import PLAN_NAME, MergeReport, ShardJob, Unit, merge_records, wait_for_records
from shards.manifest import is_plain_tar_name

WORK_DIR = ".build"


def work_dir(out: Path) -> Path:
    """The hidden folder holding a build's plan and done records."""
    return Path(out) / WORK_DIR


def plan_file(out: Path) -> Path:
    """The plan record of a build."""
    return work_dir(out) / PLAN_NAME


def build_job(out: Path, shards: list[tuple[str, str]]) -> ShardJob:
    """The engine's job of a build from its planned shards' (name, digest): the record of a shard is
    named after its digest too, so a record of another plan is never taken for this one's."""
    units = tuple(Unit(f"{name}.{digest[:16]}", name, digest) for name, digest in shards)
    return ShardJob(Path(out), work_dir(out), units)


def rejected_listing_command(path: Path) -> str:
    """A shell line that prints a rejected.parquet one file per line (pyarrow only: pandas is not installed)."""
    code = f"import pyarrow.parquet as pq; print(*pq.read_table({json.dumps(str(path))}).to_pylist(), sep=chr(10))"
    return shlex.join(["python", "-c", code])


def merge_shard_set(out: Path, *, wait_s: float = 0.0, progress: bool = True) -> MergeReport:
    """Merge the done records of a planned build into the shard set's manifest, rejections and info;
    the caller holds the folder's lock (`shards build` rank 0, or the `shards merge` command)."""
    out = Path(out)
    if not plan_file(out).is_file():
        raise FileNotFoundError(f"{out} holds no build plan ({plan_file(out)}); run relicv2 shards build first")
    try:
        plan = json.loads(plan_file(out).read_text())
        if not isinstance(plan, dict) or not {"shards", "settings", "inputs", "classes"} <= set(plan):
            raise ValueError("fields missing")
        if not all(isinstance(s, dict) and is_plain_tar_name(s.get("name")) and isinstance(s.get("digest"), str)
                   for s in plan["shards"]):
            raise ValueError("a shard entry is not a plain .tar name with a digest")
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"{plan_file(out)} is not a readable build plan ({exc}); rerun relicv2 shards build with --overwrite"
        ) from None
    job = build_job(out, [(s["name"], s["digest"]) for s in plan["shards"]])
    records = wait_for_records(job, wait_s, progress=progress,
                               rerun=f"rerun the build for the ranks that own them, then run: relicv2 shards merge {out}")
    plan_rejected = pq.read_table(work_dir(out) / "plan-rejected.parquet").to_pylist()
    converted = sum(r["manifest"].column("status").to_pylist().count("converted") for r in records)
    return merge_records(out, records, rejected=plan_rejected, info={
        **{name: plan[name] for name in ("inputs", "classes", "layout", "settings", "command", "version")},
        "prefix": plan["settings"]["prefix"],
        "converted": converted,
        "num_classes": len(plan["classes"]),
        "plan_digest": plan["digest"],
    })

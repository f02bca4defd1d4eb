"""The final step of a build: per-shard done-markers -> manifest.parquet, rejected.parquet, info.json.

Run by rank 0 at the end of `relicv2 shards build` (it waits for the other ranks' markers), or on
its own as `relicv2 shards merge DIR` once every rank has finished.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from shards.manifest import (
    REJECTED_NAME,
    is_plain_tar_name,
    rejected_table,
    write_manifest,
    write_table,
)
from shards.progress import Phase, tracked
from shards.writer import write_info

WORK_DIR = ".build"
POLL_S = 2.0


@dataclass(frozen=True)
class MergeReport:
    """Totals of a merged shard set."""

    shards: int
    written: int
    rejected: int
    rejected_by_reason: dict[str, int]
    empty_shards: list[str]


def work_dir(out: Path) -> Path:
    """The hidden folder holding a build's plan and done-markers."""
    return Path(out) / WORK_DIR


def plan_file(out: Path) -> Path:
    """The plan record of a build."""
    return work_dir(out) / "plan.json"


def done_marker(out: Path, shard) -> Path:
    """The done-marker of a planned shard (a ShardPlan, or a plan.json entry)."""
    name, digest = (shard["name"], shard["digest"]) if isinstance(shard, dict) else (shard.name, shard.digest)
    return work_dir(out) / f"{name}.{digest[:16]}.done.json"


def read_marker(out: Path, shard: dict) -> dict:
    """A done-marker's record; a clear error when it is not one."""
    path = done_marker(out, shard)
    try:
        marker = json.loads(path.read_text())
        if not isinstance(marker, dict) or not {"empty", "manifest", "rejected", "shard"} <= set(marker):
            raise ValueError("fields missing")
        return marker
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{path} is not a done-marker ({exc}); delete it and rerun the build to redo that shard") from None


def rejected_listing_command(path: Path) -> str:
    """A shell line that prints a rejected.parquet one file per line (pyarrow only: pandas is not installed)."""
    code = f"import pyarrow.parquet as pq; print(*pq.read_table({json.dumps(str(path))}).to_pylist(), sep=chr(10))"
    return shlex.join(["python", "-c", code])


def wait_for_markers(out: Path, shards: list[dict], wait_s: float, progress: bool = True) -> list[dict]:
    """Wait up to `wait_s` seconds for every shard's marker; raise naming the missing ones."""
    deadline = time.monotonic() + wait_s
    with Phase("shards merge: waiting for ranks", len(shards), unit="shard", enabled=progress and wait_s > 0) as bar:
        while True:
            done = sum(done_marker(out, s).is_file() for s in shards)
            bar.update(done - bar.count)
            if done == len(shards) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    missing = [s["name"] for s in shards if not done_marker(out, s).is_file()]
    if not missing:
        return [read_marker(out, s) for s in tracked(shards, "shards merge: reading records", len(shards),
                                                     unit="shard", enabled=progress)]
    shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
    raise RuntimeError(
        f"{len(missing)} shard(s) of {out} are not finished ({shown}); rerun the build for the "
        "ranks that own them, then run: relicv2 shards merge " + str(out)
    )


def merge_shard_set(out: Path, *, wait_s: float = 0.0, progress: bool = True) -> MergeReport:
    """Merge the done-markers of a planned build into the shard set's manifest, rejections and info.

    The caller holds the folder's lock (`shards build` rank 0, or the `shards merge` command).
    """
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
    markers = wait_for_markers(out, plan["shards"], wait_s, progress)
    rows = [row for m in markers for row in m["manifest"]]
    plan_rejected = pq.read_table(work_dir(out) / "plan-rejected.parquet").to_pylist()
    rejected = sorted(plan_rejected + [r for m in markers for r in m["rejected"]], key=lambda r: (r["source"], r["reason"]))
    write_manifest(rows, out)
    write_table(rejected_table(rejected), out / REJECTED_NAME)
    by_reason = dict(sorted(Counter(r["reason"] for r in rejected).items()))
    tars = [out / m["shard"] for m in markers if not m["empty"]]
    sizes = [p.stat().st_size for p in tars]
    empty = [m["shard"] for m in markers if m["empty"]]
    write_info(
        out,
        {
            "prefix": plan["settings"]["prefix"],
            "shards": len(tars),
            "empty_shards": empty,
            "samples": len(rows),
            "labelled": sum(r["label"] is not None for r in rows),
            "converted": sum(r["status"] == "converted" for r in rows),
            "inputs": plan["inputs"],
            "rejected": len(rejected),
            "rejected_by_reason": by_reason,
            "classes": plan["classes"],
            "num_classes": len(plan["classes"]),
            "layout": plan["layout"],
            "bytes": sum(sizes),
            "shard_bytes": {"min": min(sizes, default=0), "max": max(sizes, default=0)},
            "settings": plan["settings"],
            "plan_digest": plan["digest"],
            "command": plan["command"],
            "version": plan["version"],
        },
    )
    return MergeReport(len(tars), len(rows), len(rejected), by_reason, empty)

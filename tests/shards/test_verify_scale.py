"""`shards verify` keeps of the manifest only what a sample is checked against: at ImageNet's size the whole
manifest as dicts of every column held 2.1 GB; with the checked columns 1.5 GB (benchmarks/RESULTS.md)."""

from __future__ import annotations

import tracemalloc

import pyarrow as pa

from shards.manifest import MANIFEST_NAME, MANIFEST_SCHEMA, write_table
from shards.verify import manifest_problems

ROWS = 20_000


def test_the_manifest_is_held_as_the_checked_columns_only(tmp_path):
    columns = {field.name: pa.array([None] * ROWS, field.type) for field in MANIFEST_SCHEMA}
    columns["key"] = pa.array([f"n01440764_{i}" for i in range(ROWS)])
    columns["shard"] = pa.array([f"images-{i // 1000:06d}.tar" for i in range(ROWS)])
    columns["position"] = pa.array([i % 1000 for i in range(ROWS)], pa.int32())
    # What a build writes beside the checked columns: the source path, the status, mask statistics.
    extras = {name: pa.array([f"/data/imagenet/train/n01440764/n01440764_{i}.JPEG#{name}" for i in range(ROWS)])
              for name in ("source", "mask_status", "mask_note", "json_extra")}
    write_table(pa.table({**columns, **extras}), tmp_path / MANIFEST_NAME)
    tracemalloc.start()
    try:
        rows, problems = manifest_problems(tmp_path)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert problems == [] and len(rows) == ROWS and rows[5]["key"] == "n01440764_5"
    assert set(rows[0]) == {"key", "shard", "position", "label", "width", "height", "byte_size", "content_hash"}
    assert held < 16 * 2**20, f"the manifest's rows hold {held / 2**20:.0f} MiB for {ROWS} rows"

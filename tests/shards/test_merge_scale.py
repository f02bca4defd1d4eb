"""The merge of a shard job holds the set's manifest as columns, not as a dict a row.

At ImageNet's size (1.28 M samples in 1,000 shards) the row-wise merge held 3 GB; here 40 shards of
1,000 rows each stand in, and the Python-level peak of the merge must stay far below the rows' size
as dicts (about 50 MB here: every row a dict of ten fields).
"""

from __future__ import annotations

import json
import tracemalloc

import pyarrow.parquet as pq

from relicv2.shards.job import RECORD_SUFFIX, ShardJob, Unit, merge_records, wait_for_records
from relicv2.shards.manifest import MANIFEST_NAME

SHARDS, ROWS = 40, 1_000


def _job_with_records(tmp_path) -> ShardJob:
    out = tmp_path / "set"
    job = ShardJob(out, out / ".build", tuple(Unit(f"{n:06d}", f"images-{n:06d}.tar", f"d{n}") for n in range(SHARDS)))
    job.work.mkdir(parents=True)
    for n, unit in enumerate(job.units):
        rows = [{"key": f"k{n}_{i}", "shard": unit.shard, "position": i, "label": i % 7 if i % 5 else None,
                 "width": 64, "height": 48, "byte_size": 1000 + i, "content_hash": f"{i:032x}", "status": "ok",
                 "source": f"/data/n{n:08d}/n{n:08d}_{i}.JPEG"} for i in reversed(range(ROWS))]
        record = {"shard": unit.shard, "digest": unit.digest, "empty": False, "manifest": rows, "rejected": [],
                  "tar_bytes": 1}
        assert job.record_path(unit).name.endswith(RECORD_SUFFIX)
        job.record_path(unit).write_text(json.dumps(record))
    return job


def test_the_merge_keeps_the_manifest_as_columns(tmp_path):
    job = _job_with_records(tmp_path)
    tracemalloc.start()
    try:
        records = wait_for_records(job, 0, progress=False)
        report = merge_records(job.out, records, info={})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    manifest = pq.read_table(job.out / MANIFEST_NAME)
    assert report.written == manifest.num_rows == SHARDS * ROWS
    assert manifest.column_names[:9] == ["key", "shard", "position", "label", "width", "height", "byte_size",
                                         "content_hash", "status"] and manifest.column_names[9:] == ["source"]
    # Sorted by shard, then position, although each record lists its rows backwards.
    assert manifest.slice(0, 3).column("key").to_pylist() == ["k0_0", "k0_1", "k0_2"]
    assert manifest.slice(ROWS, 1).column("shard").to_pylist() == ["images-000001.tar"]
    info = json.loads((job.out / "info.json").read_text())
    assert info["samples"] == SHARDS * ROWS and info["labelled"] == SHARDS * (ROWS - ROWS // 5)
    assert peak < 15 * 2**20, f"the merge held {peak / 2**20:.0f} MiB of Python objects for {SHARDS * ROWS} rows"


def test_an_extra_column_typed_differently_in_two_shards_is_kept_as_json_text(tmp_path):
    out = tmp_path / "set"
    job = ShardJob(out, out / ".build", (Unit("000000", "a.tar", "d0"), Unit("000001", "b.tar", "d1")))
    job.work.mkdir(parents=True)
    for unit, value in zip(job.units, (3, "three"), strict=True):
        row = {"key": unit.id, "shard": unit.shard, "position": 0, "status": "ok", "extra": value}
        job.record_path(unit).write_text(json.dumps({"shard": unit.shard, "digest": unit.digest, "empty": False,
                                                     "manifest": [row], "rejected": [], "tar_bytes": 1}))
    merge_records(out, wait_for_records(job, 0, progress=False), info={})
    assert pq.read_table(out / MANIFEST_NAME).column("extra").to_pylist() == ["3", '"three"']

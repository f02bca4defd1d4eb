"""`shards verify` holds the manifest as columns: at ImageNet's size the manifest as one dict a row held
1.5 GB even with only the checked columns (benchmarks/RESULTS.md). Repeated keys are named, with a manifest or
without one."""

from __future__ import annotations

import io
import json
import tracemalloc

import pyarrow as pa
from PIL import Image

from relicv2.shards.manifest import MANIFEST_NAME, MANIFEST_SCHEMA, write_table
from relicv2.shards.verify import VERIFIED_COLUMNS, manifest_problems, verify_shard_set
from tests.tars import write_tar

ROWS, PER_SHARD = 40_000, 1_000


def write_manifest(folder) -> None:
    """A manifest of ROWS samples in ROWS / PER_SHARD shards (not on disk), with what a build writes beside
    the checked columns: the source path, the status, mask statistics."""
    columns = {field.name: pa.array([None] * ROWS, field.type) for field in MANIFEST_SCHEMA}
    columns["key"] = pa.array([f"n01440764_{i}" for i in range(ROWS)])
    columns["shard"] = pa.array([f"images-{i // PER_SHARD:06d}.tar" for i in range(ROWS)])
    columns["position"] = pa.array([i % PER_SHARD for i in range(ROWS)], pa.int32())
    extras = {name: pa.array([f"/data/imagenet/train/n01440764/n01440764_{i}.JPEG#{name}" for i in range(ROWS)])
              for name in ("source", "mask_status", "mask_note", "json_extra")}
    write_table(pa.table({**columns, **extras}), folder / MANIFEST_NAME)
    (folder / "info.json").write_text(json.dumps({"samples": ROWS}))


def test_the_manifest_is_held_as_the_checked_columns_only(tmp_path):
    write_manifest(tmp_path)
    table, problems = manifest_problems(tmp_path)
    assert problems == [] and table.column_names == list(VERIFIED_COLUMNS) and len(table) == ROWS


def test_verify_holds_the_manifest_as_columns_not_a_dict_a_row(tmp_path):
    write_manifest(tmp_path)
    tracemalloc.start()
    try:
        report = verify_shard_set(tmp_path, decode_images=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.samples == ROWS and len(report.problems) == ROWS // PER_SHARD
    assert report.problems[0] == "images-000000.tar: listed in the manifest but missing; rebuild the shard set"
    # A dict a row: ~20 MiB of Python objects for 40,000 rows; as columns, the shards' names and the problems.
    assert peak < 4 * 2**20, f"verify held {peak / 2**20:.1f} MiB of Python objects for {ROWS} rows"


def test_misplaced_positions_and_duplicate_keys_are_named_in_the_manifests_order(tmp_path):
    rows = [("b-000001.tar", "x", 0), ("b-000001.tar", "y", 2), ("a-000000.tar", "y", 0), ("a-000000.tar", "z", 1),
            ("c-000002.tar", "z", 1)]
    columns = {field.name: pa.array([None] * len(rows), field.type) for field in MANIFEST_SCHEMA}
    columns.update(shard=pa.array([r[0] for r in rows]), key=pa.array([r[1] for r in rows]),
                   position=pa.array([r[2] for r in rows], pa.int32()))
    write_table(pa.table(columns), tmp_path / MANIFEST_NAME)
    problems = verify_shard_set(tmp_path, decode_images=False).problems
    assert problems[:3] == ["manifest: positions of b-000001.tar are not 0..1",
                            "manifest: positions of c-000002.tar are not 0..0",
                            "manifest: 2 duplicate key(s), e.g. 'y'"]


def test_a_key_in_two_tars_of_a_set_without_a_manifest_is_one_line(tmp_path):
    def jpeg() -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, "JPEG")
        return buffer.getvalue()

    write_tar(tmp_path / "a-000000.tar", [("x.jpg", jpeg()), ("y.jpg", jpeg())])
    write_tar(tmp_path / "a-000001.tar", [("z.jpg", jpeg())])
    assert verify_shard_set(tmp_path).ok
    write_tar(tmp_path / "a-000002.tar", [("y.jpg", jpeg()), ("x.jpg", jpeg())])
    report = verify_shard_set(tmp_path, workers=2)
    assert report.samples == 5 and report.problems == [
        "2 key(s) are in more than one tar, e.g. 'y' in a-000000.tar and a-000002.tar: a sample is named by its key "
        "(key lists, evaluation caches), so give each sample its own key"]

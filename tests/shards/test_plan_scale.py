"""The build plan is computed by every rank over the whole set, so its per-image work must be small: at
ImageNet's size (1.28 M inputs) rank 0 of 64 spent most of its start-up planning."""

from __future__ import annotations

import os

import relicv2.shards.plan as plan_module
from relicv2.shards.plan import reference_digest, shard_digest
from relicv2.shards.sources import SourceImage, suffix_of


def test_a_shards_digest_is_the_formats_byte_for_byte():
    images = [SourceImage("n01/a.JPEG", "/x/a", 3, "n01", 1234, "a"),
              SourceImage('odd "quoted"\\name\t\u00e9\U0001f600.jpg', "/x/b", None, None, 0, "odd_quoted_name"),
              SourceImage("caf\u00e9/b.png", "/x/c", 0, "caf\u00e9 \u2603", 2**40, "b_1a2b3c4d")]
    settings = {"quality": 95, "name": "images-000000.tar"}
    assert shard_digest(images, settings) == reference_digest(images, settings)
    assert shard_digest([], settings) == reference_digest([], settings)


def test_a_shards_digest_calls_json_dumps_once_whatever_its_inputs(monkeypatch):
    # Every rank digests every shard of the plan: a json.dumps an input was ~40 s of CPU at ImageNet's size
    # (the CPU ratio against the reference: benchmarks/bench_shards.py --digest).
    images = [SourceImage(f"n{i % 10:08d}/n{i % 10:08d}_{i}.JPEG", f"/data/{i}", i % 10, f"n{i % 10:08d}",
                          1000 + i, f"n{i % 10:08d}_{i}") for i in range(500)]
    calls = []
    real_dumps = plan_module.json.dumps
    monkeypatch.setattr(plan_module.json, "dumps", lambda *a, **k: calls.append(1) or real_dumps(*a, **k))
    digest = shard_digest(images, {"quality": 95})
    assert len(calls) == 1  # the settings only
    monkeypatch.setattr(plan_module.json, "dumps", real_dumps)
    assert digest == reference_digest(images, {"quality": 95})


def test_an_inputs_suffix_is_what_splitext_gives():
    names = ["a/b.JPEG", "a.b/c", ".hidden", "..jpg", "..a.jpg", "a.", "dir/.x.png", "x", "a/b.tar.gz", "/abs/p.webp",
             "caf\u00e9/\u00e9t\u00e9.JPG", "a/.", "a/..", "trailing/"]
    assert [suffix_of(name) for name in names] == [os.path.splitext(name)[1] for name in names]

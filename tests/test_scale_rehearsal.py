"""The ImageNet-sized rehearsal script, at a size the suite affords: the set it makes is shaped like
ImageNet's (class folders, file names, awkward samples) and every job it probes finishes."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq

from tests.paths import REPO


def test_the_rehearsal_makes_an_imagenet_shaped_set_and_every_job_finishes(tmp_path):
    out = tmp_path / "rehearsal"
    command = [sys.executable, str(REPO / "benchmarks" / "scale_rehearsal.py"), "--out", str(out), "--samples", "4100",
               "--jobs", "build,verify,subset"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| shards ")]
    assert [row.split("|")[1].strip() for row in rows] == ["shards build", "shards verify --no-decode",
                                                           "shards subset 10%"]
    assert all(row.rstrip(" |").endswith("| 0") for row in rows), rows  # every job exited 0
    classes = sorted(p.name for p in (out / "images").iterdir())
    assert len(classes) == 1000 and classes[0].startswith("n") and len(classes[0]) == 9
    assert (out / "images" / classes[0] / f"{classes[0]}_0.JPEG").is_file()
    info = json.loads((out / "shards" / "info.json").read_text())
    # One sample in 4,000 is awkward (index 17: CMYK, converted, not rejected; the others follow at 4,017...).
    assert info["samples"] + info["rejected"] == 4100 and info["num_classes"] == 1000
    assert pq.read_table(out / "shards" / "manifest.parquet").column("status").to_pylist().count("converted") >= 1
    assert (out / "subset-10pct.txt").read_text().count("\n") >= 1000  # at least one key a class

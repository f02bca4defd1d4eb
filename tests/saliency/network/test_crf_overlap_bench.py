"""benchmarks/bench_crf_overlap.py: both orders of phase I's CRF on the same images give the same labels, timed."""

from __future__ import annotations

import re

import pytest

from tests.paths import load_benchmark
from tests.scenes import write_scenes


def test_times_both_orders_and_finds_their_labels_equal(tmp_path, capsys):
    write_scenes(tmp_path / "photos", range(6))
    script = load_benchmark("bench_crf_overlap")
    assert script.main(["--images", str(tmp_path / "photos"), "--count", "6", "--size", "32", "--epochs", "2",
                        "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "the labels of both are equal" in out
    assert re.search(r"CRF awaited [\d.]+ s, overlapped [\d.]+ s: [\d.]+x", out)


def test_too_few_photos_is_one_line_naming_the_folder(tmp_path):
    write_scenes(tmp_path / "photos", range(2))
    with pytest.raises(SystemExit, match=r"photos holds 2 readable images, fewer than --count 6"):
        load_benchmark("bench_crf_overlap").main(["--images", str(tmp_path / "photos"), "--count", "6"])

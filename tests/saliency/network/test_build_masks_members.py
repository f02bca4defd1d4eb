"""build-masks and the members of its input: a hostile json, a duplicate key, members it does not
use and an input mask are rejected, carried or replaced, each counted and named, never silent."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks, format_summary
from relicv2.shards import ReadReport, iter_samples
from relicv2.shards.build import Ranks
from relicv2.shards.sample import MASK_MEMBER
from tests.saliency.network.conftest import SquarePredictor, jpeg_bytes
from tests.scenes import synthetic_scene
from tests.tars import write_tar


def _image(seed: int) -> bytes:
    return jpeg_bytes(synthetic_scene(48, 64, seed=seed)[0])


def _run(tmp_path: Path, folder: Path, model: Path) -> dict:
    config = BuildMasksConfig(model=model, shards=folder, out=tmp_path / "out", workers=0, batch_size=2,
                              progress=False, index_cache=tmp_path / "cache")
    return build_masks(config, Ranks(), predictor=SquarePredictor())


def _rejected(out: Path) -> dict[str, str]:
    return {row["source"]: row["reason"] for row in pq.read_table(out / "rejected.parquet").to_pylist()}


def test_a_deep_json_member_is_a_rejected_row(tmp_path, tiny_model):
    folder = tmp_path / "in"
    write_tar(folder / "train-0000.tar", [("a.jpg", _image(0)), ("b.jpg", _image(1)), ("b.json", b"[" * 100_000)])
    summary = _run(tmp_path, folder, tiny_model)
    assert summary["written"] == 1 and summary["rejected"] == 1
    assert _rejected(tmp_path / "out") == {"train-0000.tar:b": "json_too_deep"}


def test_a_duplicate_key_is_a_rejected_row_not_the_end_of_the_run(tmp_path, tiny_model):
    folder = tmp_path / "in"
    write_tar(folder / "train-0000.tar", [
        ("a.jpg", _image(0)), ("c.jpg", _image(2)), ("a.jpg", _image(3)),  # `a` again: a second sample of one key
    ])
    summary = _run(tmp_path, folder, tiny_model)
    assert summary["written"] == 2 and summary["rejected"] == 1
    assert _rejected(tmp_path / "out") == {"train-0000.tar:a": "duplicate_key"}
    assert sorted(s["key"] for s in iter_samples(tmp_path / "out", report=ReadReport())) == ["a", "c"]


def test_unused_members_are_carried_and_an_input_mask_replaced_and_counted(tmp_path, tiny_model):
    folder = tmp_path / "in"
    write_tar(folder / "train-0000.tar", [
        ("a.jpg", _image(0)), ("a.txt", b"caption of a"), ("b.jpg", _image(1)), ("b.mask.png", b"an old mask"),
    ])
    summary = _run(tmp_path, folder, tiny_model)
    assert summary["written"] == 2 and summary["rejected"] == 0
    assert summary["carried_members"] == {"txt": 1} and summary["replaced_masks"] == 1
    text = format_summary(summary)
    assert "txt" in text and "1 input mask.png replaced" in text
    report = ReadReport()
    masked = {s["key"]: s for s in iter_samples(tmp_path / "out", report=report)}
    assert masked["a"]["txt"] == b"caption of a"  # carried unchanged
    assert masked["b"][MASK_MEMBER] != b"an old mask" and masked["b"][MASK_MEMBER].startswith(b"\x89PNG")

"""`benchmarks/saliency_quality.py`: trains on image folders, scores every row on held-out labelled images."""

from __future__ import annotations

import dataclasses
import json

import pytest
from PIL import Image

from tests.paths import load_benchmark
from tests.scenes import synthetic_scene, write_scenes


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trains_on_joined_folders_and_prints_every_row(tmp_path, capsys):
    write_scenes(tmp_path / "a", range(4), masks=tmp_path / "train-masks")
    write_scenes(tmp_path / "b", range(4, 8))
    write_scenes(tmp_path / "held", range(20, 23), masks=tmp_path / "masks", size=(60, 80))  # another size than the training images
    # The masks folder may hold more than the held-out images' masks (a data set's whole folder).
    Image.fromarray(synthetic_scene(60, 80, seed=30)[1]).save(tmp_path / "masks" / "other.png")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--train-images", str(tmp_path / "a"), "--train-images", str(tmp_path / "b"),
            "--heldout-images", str(tmp_path / "held"), "--heldout-masks", str(tmp_path / "masks"),
            "--train-masks", str(tmp_path / "train-masks"), "--config", "tiny", "--set", "fuse_epochs=1"]
    script = load_benchmark("saliency_quality")
    assert script.main(argv) == 0
    printed = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    # The masks build-masks writes by default (no --flip, no --crf) are marked.
    expected = ["rbd", "mr", "dsr", "mc", "mean of handcrafted", "fused network (default)", "fused network, flip",
                "fused network + CRF", "fused network, flip + CRF", "fused network + maps", "fused network, flip + maps"]
    assert [name for name in rows if name != "row"] == expected
    assert all(rows[name].rstrip(" |").endswith("| 3") for name in expected)  # every held-out image scored
    assert "wall s: training shards" in printed
    # The train side: the refined labels and the network on the 4 training images that have masks.
    train_side = printed[printed.index("train images:"):]
    assert "rbd refined it1" in train_side and "fused network" in train_side
    # Both folders were trained on (the tiny preset samples 8 images).
    assert json.loads((out / "train" / "report.json").read_text())["images"] == 8
    # The handcrafted rows find the generated objects; each row is what `saliency evaluate` gives.
    rbd_max_f = float(rows["rbd"].split("|")[3])
    assert rbd_max_f > 0.8
    from relicv2.saliency.evaluate import evaluate_folder
    scored = evaluate_folder(out / "heldout" / "maps" / "rbd", tmp_path / "masks", allow_missing=True)
    assert round(scored.max_f, 3) == rbd_max_f
    # A rerun resumes: nothing is trained or computed again.
    done = [out / "train" / "work" / "fused.done.pt", out / "heldout" / "mean" / "s20.png",
            out / "train-shards" / "info.json"]
    stamps = [path.stat().st_mtime_ns for path in done]
    assert script.main(argv) == 0
    assert [path.stat().st_mtime_ns for path in done] == stamps


def test_the_default_mark_follows_build_masks_defaults(monkeypatch):
    script = load_benchmark("saliency_quality")
    assert script.default_options() == ""
    both = dataclasses.make_dataclass("Masks", [("flip", bool, True), ("crf", bool, True), ("device", str, "auto")])
    monkeypatch.setattr(script, "BuildMasksConfig", both)
    assert script.default_options() == ", flip + CRF"


def test_bad_folders_are_one_line(tmp_path, capsys):
    write_scenes(tmp_path / "a", range(2))
    argv = ["--out", str(tmp_path / "out"), "--train-images", str(tmp_path / "a"), "--heldout-images",
            str(tmp_path / "nope"), "--heldout-masks", str(tmp_path / "a"), "--config", "tiny"]
    assert load_benchmark("saliency_quality").main(argv) == 2
    assert "--heldout-images" in capsys.readouterr().err and not (tmp_path / "out").exists()

"""`relicv2 saliency handcrafted | evaluate | preview` round trips on small synthetic data."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import webdataset as wds
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.saliency import saliency_group
from relicv2.saliency.images import read_gray
from tests.scenes import synthetic_scene


@pytest.fixture
def dataset(tmp_path):
    """Three images (one greyscale PNG) with masks, plus one corrupt file."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    for i in range(3):
        rgb, mask = synthetic_scene(90 + 10 * i, 120, seed=i)
        if i == 2:
            # The red channel keeps the object/background contrast (the channel mean nearly loses it).
            Image.fromarray(rgb[:, :, 0]).save(images / f"img{i}.png")
        else:
            Image.fromarray(rgb).save(images / f"img{i}.jpg", quality=95)
        Image.fromarray(mask).save(masks / f"img{i}.png")
    (images / "broken.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    return images, masks


def _run(args):
    return CliRunner().invoke(saliency_group, args, catch_exceptions=False)


def test_handcrafted_writes_maps_resumes_and_skips_corrupt_input(dataset, tmp_path):
    images, _ = dataset
    out = tmp_path / "maps"
    args = ["handcrafted", "--method", "rbd,mr", "--input", str(images), "--output", str(out), "--no-progress"]
    result = _run([*args, "--max-failures", "1"])
    assert result.exit_code == 0, result.output
    assert "1 failed" in result.output and "broken" in result.output
    assert " at 0x" not in result.output  # reasons without object addresses
    for method in ("rbd", "mr"):
        names = sorted(p.name for p in (out / method).iterdir())
        assert names == ["img0.png", "img1.png", "img2.png"]
        saliency = read_gray(out / method / "img1.png")
        assert saliency.shape == (100, 120) and saliency.max() == 255
    # A rerun finds everything done and recomputes nothing.
    stamp = (out / "rbd" / "img0.png").stat().st_mtime_ns
    again = _run(args)  # the default --max-failures 0: the corrupt input fails the job
    assert again.exit_code == 1
    assert "3 already complete" in again.output and "1 failed" in again.output
    assert "exceed --max-failures 0" in again.output
    assert (out / "rbd" / "img0.png").stat().st_mtime_ns == stamp


def test_handcrafted_with_worker_processes_matches_single_process(dataset, tmp_path):
    images, _ = dataset
    single, pooled = tmp_path / "single", tmp_path / "pooled"
    _run(["handcrafted", "--method", "mr", "--input", str(images), "--output", str(single), "--no-progress"])
    result = _run(
        ["handcrafted", "--method", "mr", "--input", str(images), "--output", str(pooled), "--workers", "2",
         "--no-progress", "--max-failures", "25%"]
    )
    assert result.exit_code == 0, result.output
    assert "1 failed" in result.output
    for name in ("img0.png", "img1.png", "img2.png"):
        assert (read_gray(single / "mr" / name) == read_gray(pooled / "mr" / name)).all()


def test_handcrafted_reads_a_shard_set(tmp_path):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    with wds.TarWriter(str(shard_dir / "images-000000.tar")) as sink:
        for i in range(2):
            rgb, _ = synthetic_scene(80, 100, seed=10 + i)
            buffer = io.BytesIO()
            Image.fromarray(rgb).save(buffer, format="JPEG", quality=95)
            sink.write({"__key__": f"sample{i}", "jpg": buffer.getvalue(), "cls": b"3"})
    out = tmp_path / "maps"
    result = _run(["handcrafted", "--method", "rbd", "--input", str(shard_dir), "--output", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "rbd").iterdir()) == ["sample0.png", "sample1.png"]
    assert read_gray(out / "rbd" / "sample0.png").shape == (80, 100)


def test_handcrafted_reads_a_brace_pattern_of_plain_shards(tmp_path, monkeypatch):
    # Names other tools write (4 digits), png and webp members, no manifest, no index.
    monkeypatch.setenv("RELICV2_INDEX_CACHE", str(tmp_path / "cache"))
    shard_dir = tmp_path / "plain"
    shard_dir.mkdir()
    with wds.ShardWriter(str(shard_dir / "train-%04d.tar"), maxcount=1, verbose=0) as sink:
        for i, fmt in enumerate(("PNG", "WEBP", "JPEG")):
            rgb, _ = synthetic_scene(60, 72, seed=20 + i)
            buffer = io.BytesIO()
            Image.fromarray(rgb).save(buffer, format=fmt)
            sink.write({"__key__": f"s{i}", {"PNG": "png", "WEBP": "webp", "JPEG": "jpeg"}[fmt]: buffer.getvalue()})
    out = tmp_path / "maps"
    pattern = str(shard_dir / "train-{0000..0002}.tar")
    result = _run(["handcrafted", "--method", "mc", "--input", pattern, "--output", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "3 inputs" in result.output  # the total comes from the derived indexes
    assert sorted(p.name for p in (out / "mc").iterdir()) == ["s0.png", "s1.png", "s2.png"]
    missing = _run(["handcrafted", "--method", "mc", "--input", str(shard_dir / "train-{0000..0003}.tar"),
                    "--output", str(tmp_path / "other"), "--no-progress"])
    assert missing.exit_code != 0 and "train-0003.tar" in missing.output and "Traceback" not in missing.output


def test_evaluate_prints_and_writes_scores(dataset, tmp_path):
    images, masks = dataset
    out = tmp_path / "maps"
    _run(["handcrafted", "--method", "rbd,mr", "--input", str(images), "--output", str(out), "--no-progress"])
    json_path, csv_path = tmp_path / "scores.json", tmp_path / "scores.csv"
    result = _run(["evaluate", "--pred", str(out), "--gt", str(masks), "--json", str(json_path), "--csv", str(csv_path)])
    assert result.exit_code == 0, result.output
    assert "| rbd |" in result.output and "| mr |" in result.output
    scores = json.loads(json_path.read_text())
    assert set(scores) == {"rbd", "mr"} and scores["rbd"]["count"] == 3
    # Synthetic objects are easy: both methods must score well.
    assert scores["rbd"]["max_f"] > 0.9 and scores["mr"]["mae"] < 0.1
    assert csv_path.read_text().splitlines()[0] == "method,mae,max_f,adaptive_f,s_measure,count"
    # Ground truth against itself is perfect.
    perfect = _run(["evaluate", "--pred", str(masks), "--gt", str(masks), "--json", str(json_path)])
    assert perfect.exit_code == 0
    assert json.loads(json_path.read_text())["masks"] == {
        "mae": 0.0, "max_f": 1.0, "adaptive_f": 1.0, "s_measure": pytest.approx(1.0), "count": 3
    }


def test_evaluate_complains_about_missing_and_mismatched_files(dataset, tmp_path):
    images, masks = dataset
    preds = tmp_path / "preds"
    preds.mkdir()
    Image.fromarray(np.zeros((90, 120), np.uint8)).save(preds / "img0.png")
    result = CliRunner().invoke(saliency_group, ["evaluate", "--pred", str(preds), "--gt", str(masks)])
    assert result.exit_code != 0 and "have no map" in result.output and "img1" in result.output
    allowed = CliRunner().invoke(saliency_group, ["evaluate", "--pred", str(preds), "--gt", str(masks), "--allow-missing"])
    assert allowed.exit_code == 0 and "| 1 |" in allowed.output
    Image.fromarray(np.zeros((50, 50), np.uint8)).save(preds / "img1.png")
    wrong = CliRunner().invoke(saliency_group, ["evaluate", "--pred", str(preds), "--gt", str(masks), "--allow-missing"])
    assert wrong.exit_code != 0 and "img1.png is 50x50" in wrong.output
    absent = CliRunner().invoke(saliency_group, ["evaluate", "--pred", str(tmp_path / "nope"), "--gt", str(masks)])
    assert absent.exit_code != 0 and "does not exist" in absent.output


def test_preview_writes_a_contact_sheet(dataset, tmp_path):
    images, masks = dataset
    sheet = tmp_path / "sheet.png"
    with pytest.warns(UserWarning, match="broken.jpg"):  # the corrupt file is skipped, not fatal
        result = _run(
            ["preview", "--input", str(images), "--output", str(sheet), "--method", "rbd,mr", "--count", "2",
             "--gt", str(masks)]
        )
    assert result.exit_code == 0, result.output
    picture = np.asarray(Image.open(sheet))
    # Two rows of (22-px header + 160-px tiles + 4-px gap); four tiles per row: image, rbd, mr, GT.
    assert picture.shape[0] == 2 * (22 + 160 + 4) and picture.shape[2] == 3
    assert picture.shape[1] >= 4 * 160


def test_unknown_method_is_a_usage_error(dataset, tmp_path):
    images, _ = dataset
    result = CliRunner().invoke(saliency_group, ["handcrafted", "--method", "xyz", "--input", str(images), "--output", str(tmp_path)])
    assert result.exit_code == 2 and "unknown saliency method" in result.output


def test_every_input_failing_exits_non_zero_whatever_the_limit(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.jpg", "b.png"):
        (images / name).write_bytes(b"garbage")
    result = CliRunner().invoke(
        saliency_group,
        ["handcrafted", "--method", "mc", "--input", str(images), "--output", str(tmp_path / "out"),
         "--no-progress", "--max-failures", "100%"],
    )
    assert result.exit_code == 1
    assert "2 failed" in result.output and "every input failed" in result.output


@pytest.mark.parametrize(
    "text,failed,inputs,ok",
    [("0", 0, 5, True), ("0", 1, 5, False), ("2", 2, 5, True), ("2", 3, 5, False), ("0.4", 2, 5, True),
     ("0.4", 3, 5, False), ("40%", 2, 5, True), ("100%", 4, 5, True), ("100%", 5, 5, False), ("9", 0, 0, False)],
)
def test_failure_limit_counts_and_fractions(text, failed, inputs, ok):
    from relicv2.saliency.batch import FailureLimit

    assert FailureLimit.parse(text).allows(failed, inputs) is ok


@pytest.mark.parametrize("text", ["-1", "1.5", "150%", "many", ""])
def test_bad_failure_limit_is_a_usage_error(text, tmp_path):
    result = CliRunner().invoke(
        saliency_group,
        ["handcrafted", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--max-failures", text],
    )
    assert result.exit_code == 2 and "--max-failures" in result.output


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_workers_below_one_is_a_usage_error(workers, tmp_path):
    result = CliRunner().invoke(
        saliency_group, ["handcrafted", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--workers", workers]
    )
    assert result.exit_code == 2 and "at least 1 worker" in result.output

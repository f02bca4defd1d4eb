"""`relicv2 eval robustness`: corrupted copies the same whatever the worker count, a run that resumes to the same
JSON, CE arithmetic, the released ImageNet-C layout, the OOD sets' layouts and class mappings, bad input in one
line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import relicv2.evaluation.robustness as robustness
from relicv2.cli.eval import eval_group
from relicv2.evaluation.corrupted import CorruptionSpec, corrupt_shard_set
from relicv2.evaluation.head_file import TRAINED_HEAD_FILE
from relicv2.evaluation.job import Backbone
from relicv2.evaluation.linear import LinearConfig, evaluate_linear
from relicv2.evaluation.ood import OodSetError, class_list, image_folder, objectnet_targets, targets
from relicv2.evaluation.robustness import (
    ALEXNET_ERRORS,
    RobustnessConfig,
    RobustnessJob,
    corruption_table,
    run_robustness,
)
from relicv2.pretrain.checkpoint import random_encoder
from relicv2.shards import ReadReport, iter_samples, resolve_shard_set
from tests.evaluation.conftest import write_labelled_set

CROP = 32
FAST = LinearConfig(protocol="fast", epochs=5, batch_size=16, crop_size=CROP, resize_size=36)
GRID = RobustnessConfig(corruptions=("gaussian_noise", "brightness"), severities=(1, 3), batch_size=64)


@pytest.fixture(scope="module")
def head(tmp_path_factory, shape_shards):
    """The head file of a random-init ResNet-18 (seed 0) trained on the shape set."""
    out = tmp_path_factory.mktemp("linear")
    evaluate_linear(random_encoder(18, seed=0), *shape_shards, FAST, output_dir=out)
    return out / TRAINED_HEAD_FILE


def _tars(folder: Path) -> dict[str, str]:
    return {tar.name: hashlib.sha256(tar.read_bytes()).hexdigest() for tar in sorted(folder.glob("*.tar"))}


@pytest.mark.slow
def test_the_corrupted_set_is_the_same_whatever_the_worker_count(tmp_path):
    write_labelled_set(tmp_path / "val", 40, seed=5, corrupt=1)
    source = resolve_shard_set(tmp_path / "val")
    spec = CorruptionSpec("gaussian_noise", 3, seed=7, crop_size=CROP, resize_size=36)
    one = corrupt_shard_set(source, tmp_path / "one", spec, workers=1, progress=False)
    two = corrupt_shard_set(source, tmp_path / "two", spec, workers=2, progress=False)
    assert one.merge.written == two.merge.written == 40 and one.merge.rejected == 1  # the broken JPEG, listed
    assert _tars(tmp_path / "one") == _tars(tmp_path / "two")
    again = corrupt_shard_set(source, tmp_path / "one", spec, progress=False)  # finished: kept, not redone
    assert again.shards_built == 0 and again.shards_kept == 1 and _tars(tmp_path / "one") == _tars(tmp_path / "two")
    sample = next(iter_samples(resolve_shard_set(tmp_path / "one"), report=ReadReport()))
    assert sample["meta"]["corruption"] == "gaussian_noise" and sample["meta"]["width"] == CROP
    reseeded = corrupt_shard_set(source, tmp_path / "other", CorruptionSpec("gaussian_noise", 3, seed=8,
                                 crop_size=CROP, resize_size=36), progress=False)
    assert reseeded.merge.written == 40 and _tars(tmp_path / "other") != _tars(tmp_path / "one")


def test_an_interrupted_run_resumes_to_the_same_json(shape_shards, head, tmp_path, monkeypatch):
    job = dict(backbone=Backbone(random_depth=18), head=head, config=GRID, val=shape_shards[1],
               control=Backbone(random_depth=18, seed=1), control_head=head, device="cpu")
    # the control must be scored with a head of its own encoder: a seed-1 ResNet is refused in one line
    with pytest.raises(ValueError, match="trained on another encoder") as error:
        run_robustness(RobustnessJob(output=tmp_path / "refused", **job), log=lambda _: None)
    assert "\n" not in str(error.value)
    job["control"] = Backbone(random_depth=18)
    whole = run_robustness(RobustnessJob(output=tmp_path / "whole", **job), log=lambda _: None)
    table = whole["corrupted"]
    assert list(table["corruptions"]) == ["gaussian_noise", "brightness"] and table["images"] == 36
    assert all(set(row["top1"]) == {"1", "3"} and row["ce"] == 1.0 for row in table["corruptions"].values())
    per_image = json.loads((tmp_path / "whole" / robustness.PER_IMAGE_FILE).read_text())["corrupted"]
    assert len(per_image) == 4  # which images the head got right, per set in the set's order
    for name, correct in per_image.items():
        corruption, severity = name.rsplit("-", 1)
        assert len(correct) == 36 and set(correct) <= {"0", "1"}
        assert correct.count("1") / 36 == pytest.approx(table["corruptions"][corruption]["top1"][severity], abs=1e-4)
    real, calls = robustness.score_head, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # killed while scoring the third set
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(robustness, "score_head", dying)
    with pytest.raises(KeyboardInterrupt):
        run_robustness(RobustnessJob(output=tmp_path / "resumed", **job), log=lambda _: None)
    calls.clear()
    monkeypatch.setattr(robustness, "score_head", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = run_robustness(RobustnessJob(output=tmp_path / "resumed", **job), log=lambda _: None)
    # 4 sets, each scored once: the control (the same encoder and head here) reads the model's cached score; and
    # the two scores cached before the kill are read, not computed again
    assert len(calls) == 4 - 2
    for name in ("robustness.json", robustness.PER_IMAGE_FILE):
        assert (tmp_path / "resumed" / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert resumed == whole


def test_corruption_errors_against_a_baseline():
    top1 = {"fog": {1: 0.8, 3: 0.6}, "snow": {1: 0.5, 3: 0.5}}
    table = corruption_table(top1, {"fog": 0.4, "snow": 2.0})
    assert table["corruptions"]["fog"]["ce"] == pytest.approx(0.6 / 0.4)  # (0.2 + 0.4) / 0.4
    assert table["corruptions"]["snow"]["ce"] == pytest.approx(0.5)
    assert table["mce"] == pytest.approx((1.5 + 0.5) / 2) and table["mean_top1"] == pytest.approx((0.7 + 0.5) / 2)
    assert corruption_table(top1, None)["mce"] is None
    assert len(ALEXNET_ERRORS) == 15 and ALEXNET_ERRORS["brightness"] == pytest.approx(0.564592)


def test_the_released_imagenet_c_layout(shape_shards, head, tmp_path):
    """corruption/severity/class/image folders, built into shards and scored; no CE without all severities."""
    for corruption in ("fog", "snow"):
        for label, sample in enumerate(list(iter_samples(resolve_shard_set(shape_shards[1]), report=ReadReport()))[:12]):
            folder = tmp_path / "imagenet-c" / corruption / "1" / f"class{sample['label']}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{label}.jpg").write_bytes(sample["image"])
    config = RobustnessConfig(corruptions=("fog", "snow"), severities=(1,))
    result = run_robustness(RobustnessJob(backbone=Backbone(random_depth=18), head=head, output=tmp_path / "out",
                                          config=config, imagenet_c=tmp_path / "imagenet-c", device="cpu"),
                            log=lambda _: None)
    part = result["imagenet_c"]
    assert set(part["corruptions"]) == {"fog", "snow"} and part["mce"] is None and part["baseline"] is None
    missing = RobustnessConfig(corruptions=("fog", "frost"), severities=(1,))
    with pytest.raises(FileNotFoundError, match="has no folder frost/1"):
        run_robustness(RobustnessJob(backbone=Backbone(random_depth=18), head=head, output=tmp_path / "out",
                                     config=missing, imagenet_c=tmp_path / "imagenet-c", device="cpu"),
                       log=lambda _: None)


def test_ood_layouts_and_class_mappings(tmp_path):
    imagenet = class_list("imagenet")
    assert len(imagenet) == 1000 and imagenet == sorted(set(imagenet))
    for name in ("imagenet-r", "imagenet-a"):
        subset = class_list(name)
        assert len(set(subset)) == 200 and set(subset) <= set(imagenet)
    # ImageNetV2: folder k is ImageNet class k, wherever the head puts it
    reversed_head = imagenet[::-1]
    assert targets("imagenetv2-matched-frequency", ["0", "10", "999"], reversed_head, tmp_path) == [[999], [989], [0]]
    assert targets("imagenet-r", ["n01443537"], imagenet, tmp_path) == [[imagenet.index("n01443537")]]
    # a folder whose classes differ is named in one line
    root = tmp_path / "r"
    for wnid in [*class_list("imagenet-r")[1:], "zebra"]:
        (root / wnid).mkdir(parents=True)
    with pytest.raises(OodSetError) as error:
        image_folder("imagenet-r", root)
    assert str(error.value) == (f"{root} is not imagenet-r's layout: 1 of its 200 class folders are missing "
                                "(n01443537); 1 folders are not imagenet-r classes (zebra)")
    shutil.rmtree(root / "zebra")
    (root / "n01443537").mkdir()
    assert image_folder("imagenet-r", root) == root
    with pytest.raises(OodSetError, match="unknown out-of-distribution set 'imagenet-q'"):
        image_folder("imagenet-q", root)


def _objectnet_mappings(folder: Path, to_imagenet: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "folder_to_objectnet_label.json").write_text(json.dumps(
        {"alarm_clock": "Alarm clock", "bottle": "Bottle", "pen": "Pen"}))
    (folder / "objectnet_to_imagenet_1k.json").write_text(json.dumps(to_imagenet))
    # 2012 ids (1-based) in reverse of the standard order, labels by 2012 id
    (folder / "pytorch_to_imagenet_2012_id.json").write_text(json.dumps({str(i): 1000 - i for i in range(1000)}))
    (folder / "imagenet_to_label_2012_v2").write_text("".join(f"label {i}\n" for i in range(1000)))
    return folder


def test_objectnet_classes_through_its_own_mapping_and_a_mapping_that_does_not_match(tmp_path):
    imagenet = class_list("imagenet")
    index = {wnid: i for i, wnid in enumerate(imagenet)}
    mappings = _objectnet_mappings(tmp_path / "ok", {"Alarm clock": "label 0; label 2", "Bottle": "label 999"})
    # label j is 2012 id j + 1, which is standard index 999 - j; "Pen" overlaps nothing: its images are left out
    assert objectnet_targets(["alarm_clock", "bottle", "pen"], mappings, index) == [[997, 999], [0], []]
    bad = _objectnet_mappings(tmp_path / "bad", {"Bottle": "beer bottle"})
    with pytest.raises(OodSetError, match="maps 'Bottle' to 'beer bottle', which imagenet_to_label_2012_v2 does "
                                          "not list: the mapping does not match"):
        objectnet_targets(["bottle"], bad, index)


def test_bad_input_is_one_line(shape_shards, head, tmp_path):
    base = ["robustness", "--random-init", "18", "--head", str(head), "--output", str(tmp_path / "out"),
            "--device", "cpu"]
    runner = CliRunner()
    cases = [
        ([*base, "--val", str(shape_shards[1]), "--set", "corruptions=fog,smog"], "unknown corruption 'smog'"),
        ([*base, "--val", str(shape_shards[1]), "--set", "severities=6"], "severity 6 is not one of 1, 2, 3, 4, 5"),
        (base, "give at least one set to score"),
        ([*base, "--ood", "imagenet-r"], "'imagenet-r' is not NAME=FOLDER"),
        ([*base, "--ood", f"imagenet-r={tmp_path / 'nowhere'}"], "is not a folder"),
        ([*base, "--val", str(shape_shards[1]), "--ood", f"imagenet-a={tmp_path}"], "is not imagenet-a's layout"),
        ([*base, "--val", str(shape_shards[1]), "--control-random-init", "18"], "the control needs both"),
        ([*base[:2], "34", *base[3:], "--val", str(shape_shards[1])], "trained on another encoder"),
    ]
    for args, message in cases:
        result = runner.invoke(eval_group, args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "corrupted").exists()  # every set is checked before any is corrupted
    (tmp_path / "foreign.pt").write_bytes(b"junk")
    result = runner.invoke(eval_group, [*base[:4], str(tmp_path / "foreign.pt"), *base[5:], "--val", str(shape_shards[1])])
    assert result.exit_code == 1 and "foreign.pt is not a readable linear head file" in result.output


def test_the_report_shows_a_robustness_json_and_names_a_broken_one(tmp_path):
    from relicv2.evaluation.report.html import ReportInputs, build_report

    table = corruption_table({"fog": {1: 0.8125, 3: 0.5}, "snow": {1: 0.75, 3: 0.25}}, {"fog": 1.0, "snow": 1.0})
    (tmp_path / "robustness.json").write_text(json.dumps({
        "encoder": "runs/r50", "head": "lin/trained-head.pt", "protocol": "linear-fast",
        "corrupted": {"source": "val", "baseline": "runs/control", **table},
        "ood": {"imagenet-r": {"folder": "r", "classes": 200, "top1": 0.3125, "num_images": 30000}}}))
    summary = build_report(ReportInputs(robustness=tmp_path / "robustness.json"), tmp_path / "r.html")
    assert summary.sections["robustness"] == "ok" and [f.name for f in summary.figures] == ["robustness-corrupted.png"]
    text = summary.page.read_text()
    for shown in ("0.8125", "0.6562", "0.3125", "imagenet-r", "mCE against runs/control: 0.8438", "0.6875"):
        assert shown in text
    (tmp_path / "broken.json").write_text('{"encoder": "x"}')
    broken = build_report(ReportInputs(robustness=tmp_path / "broken.json"), tmp_path / "b.html")
    assert broken.sections["robustness"].startswith("not run") and any("broken.json" in p for p in broken.problems)
    assert "robustness" not in build_report(ReportInputs(), tmp_path / "none.html").sections


def test_an_imagenet_r_folder_is_scored_among_its_200_classes_only(tmp_path):
    """A bias-only 1,000-way head whose largest output is tench (not an ImageNet-R class) and second largest
    n01443537 (one): restricted to ImageNet-R's 200 classes, every image is called n01443537."""
    import numpy as np
    import torch
    from torch import nn

    from relicv2.evaluation.head_file import save_head
    from tests.evaluation.conftest import shape_image

    imagenet, subset = class_list("imagenet"), class_list("imagenet-r")
    linear = nn.Linear(512, 1000)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
        linear.bias[imagenet.index("n01440764")] = 20.0  # tench
        linear.bias[imagenet.index("n01443537")] = 10.0
    head = save_head(tmp_path / "head.pt", linear, encoder=random_encoder(18, seed=0), classes=imagenet, mean=None,
                     std=None, crop_size=CROP, resize_size=36, protocol="linear-fast")
    rng = np.random.default_rng(0)
    for wnid in subset:
        (tmp_path / "r" / wnid).mkdir(parents=True)
        for i in range(2 if wnid == "n01443537" else 1):
            (tmp_path / "r" / wnid / f"{i}.jpg").write_bytes(shape_image(i, rng))
    result = run_robustness(RobustnessJob(backbone=Backbone(random_depth=18), head=head, output=tmp_path / "out",
                                          ood=(("imagenet-r", tmp_path / "r"),), device="cpu"), log=lambda _: None)
    row = result["ood"]["imagenet-r"]
    assert (row["num_images"], row["classes"]) == (201, 200) and row["top1"] == pytest.approx(2 / 201, abs=1e-6)
    # a folder that is not the named set's layout is refused before anything is built
    sketch = tmp_path / "sketch"
    (sketch / "n01440764").mkdir(parents=True)
    with pytest.raises(OodSetError, match="999 of its 1000 class folders are missing"):
        run_robustness(RobustnessJob(backbone=Backbone(random_depth=18), head=head, output=tmp_path / "out2",
                                     ood=(("imagenet-sketch", sketch),), device="cpu"), log=lambda _: None)


def test_a_head_with_views_too_small_to_corrupt_is_refused_before_any_work(shape_shards, tmp_path):
    from torch import nn

    from relicv2.evaluation.corruptions import CorruptionError
    from relicv2.evaluation.head_file import save_head

    small = save_head(tmp_path / "head.pt", nn.Linear(512, 6), encoder=random_encoder(18, seed=0), classes=None,
                      mean=None, std=None, crop_size=16, resize_size=18, protocol="linear-fast")
    with pytest.raises(CorruptionError, match="takes 16 px views; the corruptions need at least 32 px"):
        run_robustness(RobustnessJob(backbone=Backbone(random_depth=18), head=small, output=tmp_path / "out",
                                     val=shape_shards[1], device="cpu"), log=lambda _: None)
    assert not (tmp_path / "out" / "corrupted").exists()

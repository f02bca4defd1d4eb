"""Transfer: the sweep chooses on val and scores test once, the metrics, train + val retraining, the carved
val split, resume to the same JSON, fine-tuning through the supervised loop, one line for bad input."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import relicv2.evaluation.transfer as transfer
from relicv2.cli.eval import eval_group
from relicv2.evaluation.job import Backbone
from relicv2.evaluation.report.html import ReportInputs, build_report
from relicv2.evaluation.transfer import (
    Points,
    TransferConfig,
    TransferJob,
    carve_val,
    fit_logistic,
    linear_sweep,
    run_transfer,
    scores,
    sweep,
)
from relicv2.shards import resolve_shard_set
from relicv2.shards.subset import keys_and_labels
from tests.evaluation.conftest import NUM_CLASSES

TINY = {"crop_size": 32, "resize_size": 36, "l2_points": 6, "feature_batch": 64}


def rows(points: list[tuple[list[float], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([p for p, _ in points]), torch.tensor([label for _, label in points])


def test_the_sweep_chooses_on_val_and_scores_only_that_point_on_test(tmp_path):
    # Train: 30 of class 0 near -1, 10 of class 1 near +1. Val: class 0 images that look like class 1, so
    # only the strongest penalties (which predict the majority class) are right on val; on test (clean) the
    # weak penalties are the best, and must not be chosen.
    noise = torch.linspace(-0.1, 0.1, 10).tolist()
    train = rows([([-1 + n], 0) for n in noise] * 3 + [([1 + n], 1) for n in noise])
    val = rows([([1 + n], 0) for n in noise])
    test = rows([([-1 + n], 0) for n in noise] + [([1 + n], 1) for n in noise])
    config = TransferConfig(l2_min=1e-6, l2_max=1e3, l2_points=4)
    result = linear_sweep(train, val, test, 2, config, Points(tmp_path, {}))
    assert [p["l2"] for p in result["swept"]] == pytest.approx([1e3, 1e0, 1e-3, 1e-6])
    assert result["swept"][0]["val"]["top1"] == 1.0 and result["swept"][-1]["val"]["top1"] == 0.0
    assert result["chosen"] == {"l2": pytest.approx(1e3)}
    assert all(set(p) == {"l2", "val"} for p in result["swept"])  # no test figure for a swept point
    # The chosen penalty predicts the majority class: half the test set. The weakest would score it all.
    assert result["test"]["top1"] == 0.5 and result["test_metric"] == 0.5
    weakest = fit_logistic(*train, l2=1e-6, max_iter=1000)
    assert scores(weakest(test[0], 2), test[1], 2)["top1"] == 1.0


def test_only_the_chosen_point_is_scored_on_test_and_the_metric_decides(tmp_path):
    val = {"a": {"top1": 0.8, "mean_per_class": 0.5}, "b": {"top1": 0.7, "mean_per_class": 0.75}}
    grid = [{"x": 1.0}, {"x": 2.0}]
    for metric, chosen in (("top1", 1.0), ("mean_per_class", 2.0)):
        tested = []
        result = sweep(grid, lambda p: val["a" if p["x"] == 1 else "b"],
                       lambda p, tested=tested: tested.append(p) or {"top1": 0.1, "mean_per_class": 0.2}, metric,
                       Points(tmp_path / metric, {}))
        assert tested == [{"x": chosen}] and result["chosen"] == {"x": chosen}
        assert result["test_metric"] == {"top1": 0.1, "mean_per_class": 0.2}[metric]


def test_mean_per_class_accuracy_on_an_unbalanced_set():
    # 8 of class 0, all right; 2 of class 1, one right: top-1 9/10, mean per-class (1 + 1/2) / 2.
    labels = torch.tensor([0] * 8 + [1, 1])
    logits = torch.tensor([[1.0, 0.0]] * 8 + [[0.0, 1.0], [1.0, 0.0]])
    figures = scores(logits, labels, 2)
    assert figures["top1"] == 0.9 and figures["mean_per_class"] == 0.75
    assert figures["per_class"] == {"0": 1.0, "1": 0.5}


def test_the_final_fit_uses_train_and_val(tmp_path):
    # Class 2 appears in val (and test) only: a final fit on train alone could never predict it.
    train = rows([([-1.0, 0.0], 0)] * 5 + [([1.0, 0.0], 1)] * 5)
    val = rows([([0.0, 3.0], 2)] * 5)
    test = rows([([-1.0, 0.0], 0), ([1.0, 0.0], 1), ([0.0, 3.0], 2)])
    config = TransferConfig(l2_min=1e-4, l2_max=1e-4, l2_points=1)
    result = linear_sweep(train, val, test, 3, config, Points(tmp_path, {}))
    assert result["num_train_final"] == 15 and result["test"]["top1"] == 1.0
    only_train = fit_logistic(*train, l2=1e-4, max_iter=1000)
    assert scores(only_train(test[0], 3), test[1], 3)["top1"] == pytest.approx(2 / 3)


def test_the_carved_val_split_is_per_class_seeded_and_disjoint(shape_shards):
    train = resolve_shard_set(shape_shards[0])
    labels = dict(keys_and_labels(train)[0])
    kept, val = carve_val(train, 0.25, seed=0)
    assert not kept & val and kept | val == set(labels)
    per_class = Counter(labels[key] for key in val)
    total = Counter(labels.values())
    assert per_class == {c: int(n * 0.25 + 0.5) for c, n in total.items()}
    assert carve_val(train, 0.25, seed=0) == (kept, val)
    assert carve_val(train, 0.25, seed=1)[1] != val


def _job(shape_shards, out, **config):
    return TransferJob(backbone=Backbone(random_depth=18), train=shape_shards[0], test=shape_shards[1], output=out,
                       config=TransferConfig(**{**TINY, **config}), device="cpu")


def test_an_interrupted_run_resumes_to_the_same_json(shape_shards, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = run_transfer(_job(shape_shards, out), log=lambda _: None)
    assert first["val_split"].startswith("carved: 0.2 of each class of train, seed 0")
    assert first["num_train"] + first["num_val"] == 72 and first["num_test"] == 36  # 73 minus the broken JPEG
    assert len(first["swept"]) == 6 and first["test"]["top1"] is not None
    saved = (out / "transfer.json").read_text()
    assert json.loads(saved) == first
    # The run is cut short: the final point and one swept point are lost.
    points = sorted((out / "points").glob("*.json"))
    assert len(points) == 7
    final = [p for p in points if p.name.startswith("final,")]
    assert len(final) == 1
    for path in (final[0], next(p for p in points if p not in final)):
        path.unlink()
    fits = []
    real = transfer.fit_logistic
    monkeypatch.setattr(transfer, "fit_logistic", lambda *a, **k: fits.append(1) or real(*a, **k))
    (out / "transfer.json").unlink()
    assert run_transfer(_job(shape_shards, out), log=lambda _: None) == first
    assert len(fits) == 2 and (out / "transfer.json").read_text() == saved
    fits.clear()
    again = run_transfer(_job(shape_shards, out, metric="mean_per_class"), log=lambda _: None)
    assert again["swept"] == first["swept"] and again["metric"] == "mean_per_class"  # the points are reused
    assert len(fits) == (0 if again["chosen"] == first["chosen"] else 1)


def test_finetuning_sweeps_the_grid_through_the_supervised_loop(shape_shards, tmp_path):
    out = tmp_path / "ft"
    job = _job(shape_shards, out, epochs=1, batch_size=16, learning_rates=(0.01,), weight_decays=(0.0, 1e-4),
               workers=0)
    job = TransferJob(**{**job.__dict__, "finetune": True, "val": shape_shards[1]})
    result = run_transfer(job, log=lambda _: None)
    assert result["protocol"] == "transfer-finetune" and result["val_split"] == "given"
    assert [(p["lr"], p["wd"]) for p in result["swept"]] == [(0.01, 0.0), (0.01, 1e-4)]
    assert result["num_train"] == 72 and result["num_val"] == 36 and result["num_train_final"] == 108
    assert set(result["test"]["per_class"]) <= {str(c) for c in range(NUM_CLASSES)}
    assert not list((out / "points").glob("*.pt"))  # the weights of the points are not kept
    # The report's transfer section: a row for the file, the unreadable one named among the problems.
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"protocol": "linear-fast", "top1": 0.5}))
    summary = build_report(ReportInputs(transfer=(out / "transfer.json", foreign)), tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert summary.sections["transfer"] == "ok" and "transfer-finetune" in page
    assert f"{result['test']['top1']:.4f}"[:5] in page
    assert any("foreign.json: not a transfer.json" in problem for problem in summary.problems)


def test_bad_input_is_one_line(shape_shards, tmp_path):
    for split, names in (("train", "ab"), ("test", "ac")):  # class folders whose classes differ
        for name in names:
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (40, 40), (40 * i, 90, 200)).save(tmp_path / split / name / f"{i}.jpg")
    runner = CliRunner()
    base = ["transfer", "--random-init", "18", "--output", str(tmp_path / "o"), "--device", "cpu",
            "--set", "crop_size=32"]
    for args, message in (
        (["--train", str(tmp_path / "missing"), "--test", str(shape_shards[1])], "missing"),
        (["--train", str(shape_shards[0]), "--test", str(shape_shards[0])], "share"),
        (["--train", str(tmp_path / "train"), "--test", str(tmp_path / "test")], "class"),
        (["--train", str(shape_shards[0]), "--test", str(shape_shards[1]), "--set", "metric=top5"], "metric"),
        (["--train", str(shape_shards[0]), "--test", str(shape_shards[1]), "--set", "val_fraction=1"],
         "val_fraction"),
    ):
        result = runner.invoke(eval_group, base + args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output and result.output.strip().splitlines()[-1].startswith("Error")

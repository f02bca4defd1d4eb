"""`relicv2 report`: the page reads every figure from the jobs' own files, and opens in a real browser."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.main import cli
from relicv2.evaluation.background_set import VariantSettings, build_variant_set
from relicv2.evaluation.backgrounds import VARIANTS
from relicv2.evaluation.report.html import SECTIONS, ReportInputs, build_report
from relicv2.evaluation.report.inputs import (
    read_backgrounds,
    read_eval_results,
    read_run_metrics,
    read_saliency_samples,
)
from relicv2.shards import ShardSample, write_shard_set
from tests.e2e.conftest import open_page
from tests.evaluation.backdrops import write_crafted_set


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _jpg(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


@pytest.fixture()
def outputs(tmp_path: Path) -> ReportInputs:
    """What the jobs of a small run leave behind, written by hand in their documented formats."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "epoch": s / 3, "loss": 5.0 - 0.5 * s, "contrastive": 4.0 - 0.4 * s,
                         "invariance": 1.0 - 0.1 * s, "lr": 0.1 * s, "ema": 0.99, "img/s": 50.0})
             for s in range(1, 7)]
    lines.insert(3, json.dumps({"step": 3, "knn_top1": 0.40, "knn_skipped": 0.0}))
    # A resumed run re-logs steps 5 and 6 with other values: the later records must win.
    lines += [json.dumps({"step": s, "epoch": s / 3, "loss": 1.25, "contrastive": 1.0, "invariance": 0.25,
                          "lr": 0.2, "ema": 0.995, "images_per_s": 60.0}) for s in (5, 6)]
    lines.append(json.dumps({"step": 6, "knn_top1": 0.55, "knn_skipped": 0.0}))
    lines.append('{"step": 7, "loss": 0.9, "contr')  # the killed job's half-written last line
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "config.yaml").write_text("derived:\n  steps_per_epoch: 3\n")

    evals = tmp_path / "eval"
    evals.mkdir()
    for name, protocol, checkpoint, depth, top1 in (
            ("knn", "knn", str(run), None, 0.8125), ("knn-random", "knn", None, 18, 0.4375),
            ("linear", "linear-fast", str(run / "checkpoint-000000006.pt"), None, 0.875),
            ("linear-random", "linear-fast", None, 18, 0.5)):
        (evals / f"{name}.json").write_text(json.dumps({
            "protocol": protocol, "checkpoint": checkpoint, "random_init": depth, "top1": top1,
            "top5": None if protocol == "knn" else 1.0, "num_train": 190, "num_val": 64}))
    (evals / "broken.json").write_text('{"protocol": "knn"')

    saliency_report = tmp_path / "saliency" / "report.json"
    saliency_report.parent.mkdir()
    saliency_report.write_text(json.dumps({
        "preset": "tiny",
        "methods": {"rbd": {"raw": {"mae": 0.21, "max_f": 0.61}, "iteration_1": {"mae": 0.17, "max_f": 0.66}}},
        "fused": {"mae": 0.12, "max_f": 0.71}, "mean_of_handcrafted": {"mae": 0.19, "max_f": 0.63}}))

    # A masked shard set: each image with a soft mask that is 1 on its central square (a quarter of it).
    rng = np.random.default_rng(0)
    mask = np.zeros((48, 64), np.uint8)
    mask[12:36, 16:48] = 255
    samples = [ShardSample(key=f"img_{i}", members={"jpg": _jpg(rng.integers(0, 255, (48, 64, 3), np.uint8)),
                                                     "mask.png": _png(mask)}, label=i % 2,
                           meta={"width": 64, "height": 48}) for i in range(3)]
    masked = tmp_path / "masked"
    write_shard_set(samples, masked, prefix="masked")
    maps = tmp_path / "maps"
    for method in ("rbd", "mr", "dsr", "mc"):
        (maps / method).mkdir(parents=True)
        for key in ("img_1", "img_2"):
            (maps / method / f"{key}.png").write_bytes(_png(rng.integers(0, 255, (24, 32), np.uint8)))
    views = tmp_path / "views-masked.png"
    views.write_bytes(_png(rng.integers(0, 255, (40, 120, 3), np.uint8)))
    # eval backgrounds: its variant set (made by the job's own code) and its JSON
    write_crafted_set(tmp_path / "backdrops", "background", seed=0, per_class=2)
    backgrounds = tmp_path / "backgrounds"
    build_variant_set(tmp_path / "backdrops", None, backgrounds / "variants", VariantSettings(0, 32, 32), progress=False)
    (backgrounds / "backgrounds.json").write_text(json.dumps({
        "accuracy": {name: 0.5 for name in VARIANTS} | {"mixed_same": 0.96, "mixed_rand": 0.33}, "bg_gap": 0.63,
        "follows_background": {"mixed_rand": 0.91}, "images": 6, "num_val": 6, "excluded": {},
        "variant_set": "variants"}))
    return ReportInputs(run_dir=run, eval_json=(evals,), saliency_report=saliency_report, maps_dir=maps,
                        shards=masked, views=(views,), count=2, backgrounds=backgrounds)


def test_metrics_are_read_from_the_run_file_last_record_of_a_step_wins(outputs: ReportInputs):
    metrics = read_run_metrics(outputs.run_dir)
    assert [r["step"] for r in metrics.steps] == [1, 2, 3, 4, 5, 6]
    assert metrics.steps[-1]["loss"] == 1.25 and metrics.steps[-1]["images_per_s"] == 60.0
    assert [(r["epoch"], r["knn_top1"]) for r in metrics.knn] == [(1.0, 0.40), (2.0, 0.55)]
    assert len(metrics.problems) == 1 and "metrics.jsonl:11" in metrics.problems[0]


def test_eval_files_are_validated_and_sorted_trained_before_random(outputs: ReportInputs):
    results, problems = read_eval_results(list(outputs.eval_json))
    assert [(r.protocol, r.random_init, r.top1) for r in results] == [
        ("knn", False, 0.8125), ("knn", True, 0.4375), ("linear-fast", False, 0.875), ("linear-fast", True, 0.5)]
    assert results[1].encoder == "random init ResNet-18"
    assert len(problems) == 1 and "broken.json" in problems[0]


def test_saliency_samples_prefer_images_with_maps_and_carry_the_masks(outputs: ReportInputs):
    samples, problems = read_saliency_samples(outputs.shards, outputs.maps_dir, count=2)
    assert [s.key for s in samples] == ["img_1", "img_2"] and not problems
    for sample in samples:
        assert set(sample.maps) == {"rbd", "mr", "dsr", "mc"}
        assert sample.maps["rbd"].shape == sample.image.shape[:2]  # maps resized to the image
        assert (sample.mask >= 0.5).mean() == pytest.approx(0.25, abs=0.01)


def test_report_has_every_section_filled_from_the_files(outputs: ReportInputs, tmp_path: Path):
    summary = build_report(outputs, tmp_path / "out" / "report.html")
    assert summary.sections == {sid: "ok" for sid, _ in SECTIONS}
    text = summary.page.read_text()
    for number in ("0.8125", "0.4375", "0.8750", "0.5000", "0.7100", "+0.3750", "0.6300", "0.9100"):  # the JSONs
        assert number in text
    assert "final loss 1.2500" in text  # the resumed run's last record
    assert any("broken.json" in p for p in summary.problems) and "Inputs left out" in text
    names = {p.name for p in summary.figures}
    assert names == {"saliency.png", "views-0-views-masked.png", "loss.png", "lr.png", "knn.png", "evaluation.png",
                     "backgrounds.png"}
    for figure in summary.figures:
        assert figure.parent == tmp_path / "out" / "report-figures"
        assert Image.open(figure).size[0] > 100


def test_the_backgrounds_composites_are_each_variant_of_the_same_images(outputs: ReportInputs):
    result, rows, problems = read_backgrounds(outputs.backgrounds / "backgrounds.json", count=2)
    assert result["bg_gap"] == 0.63 and not problems and len(rows) == 2
    for key, images in rows:
        assert key.startswith("c") and list(images) == list(VARIANTS) and images["original"].shape == (32, 32, 3)
        assert images["only_fg"][0, 0].max() < 30  # the background blacked out
        assert not np.array_equal(images["mixed_rand"], images["original"])
    moved = outputs.backgrounds / "moved.json"  # a JSON away from its variant set: the table alone
    moved.write_text((outputs.backgrounds / "backgrounds.json").read_text().replace('"variants"', '"gone"'))
    assert read_backgrounds(moved, count=2)[1] == []


def test_missing_inputs_say_not_run(tmp_path: Path):
    summary = build_report(ReportInputs(run_dir=tmp_path / "no-run"), tmp_path / "report.html")
    assert all(status.startswith("not run") for status in summary.sections.values())
    assert summary.page.read_text().count('class="not-run"') == len(SECTIONS)
    with pytest.raises(ValueError, match="must end in .html"):
        build_report(ReportInputs(), tmp_path / "report.txt")


def test_cli_writes_the_page_and_prints_each_section(outputs: ReportInputs, tmp_path: Path):
    out = tmp_path / "cli" / "report.html"
    args = ["report", "--out", str(out), "--run", str(outputs.run_dir), "--eval", str(outputs.eval_json[0]),
            "--views", str(outputs.views[0])]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "training           ok" in result.output and "saliency           not run" in result.output
    assert out.is_file()
    nothing = CliRunner().invoke(cli, ["report", "--out", str(tmp_path / "empty.html"), "--run", str(tmp_path)])
    assert nothing.exit_code == 1 and "no section could be built" in nothing.output
    assert (tmp_path / "empty.html").is_file()  # the page still says what is missing


def test_report_opens_in_a_headless_browser_with_every_image_loaded(outputs: ReportInputs, tmp_path: Path,
                                                                    browser):
    summary = build_report(outputs, tmp_path / "report.html")
    seen = open_page(browser, summary.page)
    assert len(seen["images"]) == len(summary.figures) == 7
    broken = [image["src"] for image in seen["images"] if not image["complete"] or image["width"] == 0]
    assert not broken, f"images that did not load: {broken}"
    assert all(not image["src"].startswith(("/", "http", "file:")) for image in seen["images"])  # relative
    evaluation = [t for t in seen["tables"] if t["cls"] == "evaluation"]
    assert evaluation == [{"cls": "evaluation", "rows": 4}]
    assert set(seen["sections"]) >= {sid for sid, _ in SECTIONS}
    assert "0.8125" in seen["sections"]["evaluation"]
    assert not seen["remote"], f"the page asked for remote resources: {seen['remote']}"


def test_named_inputs_that_hold_nothing_are_listed_and_gains_pair_only_the_same_data(outputs: ReportInputs,
                                                                                      tmp_path: Path):
    (tmp_path / "shards-like").mkdir()
    evals = outputs.eval_json[0]
    (evals / "knn-random-bigger-val.json").write_text(json.dumps({
        "protocol": "knn", "checkpoint": None, "random_init": 18, "top1": 0.1, "top5": None,
        "num_train": 190, "num_val": 128}))
    result = CliRunner().invoke(cli, [
        "report", "--out", str(tmp_path / "r.html"), "--run", str(tmp_path / "shards-like"), "--maps",
        str(tmp_path / "nope"), "--eval", str(evals), "--eval", str(evals / "broken.json")])
    assert result.exit_code == 0, result.output
    assert f"left out: --run {tmp_path / 'shards-like'}: has no metrics.jsonl" in result.output
    assert f"left out: --maps {tmp_path / 'nope'}: does not exist" in result.output
    assert result.output.count("broken.json: not an eval result") == 1  # a folder and a file in it: once
    page = (tmp_path / "r.html").read_text()
    assert "knn (190 train / 64 val images): pretrained 0.8125 vs random init 0.4375" in page
    assert "0.1000 (" not in page and "vs random init 0.1000" not in page  # never paired across val sets


def test_the_report_opens_with_a_summary_of_the_run(outputs: ReportInputs, tmp_path: Path):
    run = Path(outputs.run_dir)
    steps = [{"step": s, "time": 1000.0 + 30 * s, "loss": 2.0, "images_per_s": 40.0 + s, "data_wait_s": 0.01 * s,
              "masked_fraction": 0.1 if s % 2 else 0.0} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in steps))
    (run / "config.yaml").write_text("model:\n  depth: 18\n  width: 1\ndata:\n  train_shards: shards/masked-train\n"
                                     "optim:\n  global_batch: 32\nderived:\n  steps_per_epoch: 5\n")
    page = build_report(outputs, tmp_path / "report.html").page.read_text()
    summary = page.split('<section id="summary">')[1].split("</section>")[0]
    assert page.index('id="summary"') < page.index('id="saliency"')  # first on the page
    for fact in ("ResNet-18", "shards/masked-train", "5 (global batch 32)", "0:02:00", "43", "0.03", "0.06"):
        assert fact in summary, fact  # wall 4 x 30 s; median 43 img/s and 0.03 s wait; mean masked 0.3 / 5
    assert "+0.3750" in summary  # the pretrained encoder's gain over random init, as in the evaluation section


def test_deeply_nested_json_and_yaml_are_inputs_left_out_not_a_crash(outputs: ReportInputs, tmp_path: Path):
    """JSON nested past any stack (a metrics line, an eval file, the saliency report) and a config.yaml of
    aliases are left out with the other malformed inputs; the rest of the report is built."""
    deep = "[" * 100_000 + "]" * 100_000
    run = Path(outputs.run_dir)
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 8, "loss": ' + deep + "}\n")
    (run / "config.yaml").write_text("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nderived:\n  steps_per_epoch: 3\n")
    (outputs.eval_json[0] / "deep.json").write_text(deep)
    saliency = tmp_path / "deep-report.json"
    saliency.write_text('{"methods": ' + deep + "}")
    result = CliRunner().invoke(cli, ["report", "--out", str(tmp_path / "r.html"), "--run", str(run), "--eval",
                                      str(outputs.eval_json[0]), "--saliency-report", str(saliency)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "RecursionError" not in result.output
    assert "metrics.jsonl:12: not a metrics record" in result.output
    assert "deep.json: not an eval result" in result.output and "deep-report.json" in result.output
    assert "0.8125" in (tmp_path / "r.html").read_text()  # the good eval files are still shown
    assert read_run_metrics(run).config == {}  # hostile settings are no settings

"""Settings a user can get silently wrong are refused before any step, with one line naming the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relicv2.pretrain.config import ConfigError
from relicv2.shards import ShardSample, write_shard_set
from tests.pretrain.conftest import quiet_run, tiny_config
from tests.pretrain.views.test_loader import jpeg, png
from tests.threads import one_torch_thread

SHARDS = ("data.source=shards", "views.backend=reference", "views.num_threads=1", "optim.epochs=2",
          "run.checkpoint_every=100")


def _shard_set(folder, *, masks: bool):
    mask = np.zeros((40, 40), np.uint8)
    mask[8:32, 8:32] = 255  # covers 36% of the image: every sample may be masked
    members = (lambda i: {"jpg": jpeg(i), "mask.png": png(mask)}) if masks else (lambda i: {"jpg": jpeg(i)})
    write_shard_set([ShardSample(f"s{i:02d}", members(i), i % 2, {}) for i in range(16)], folder, max_count=8)
    return folder


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("masks", "p_m", "fix"), [
    (False, "0.1", "carries no saliency masks.*set views.mask_probability=0 to pretrain without masking"),
    (True, "0.0", "carries saliency masks that views.mask_probability=0 never applies: set views.mask_probability=0.1"),
])
def test_masking_that_disagrees_with_the_data_is_refused_before_any_step(tmp_path, masks, p_m, fix):
    shards = _shard_set(tmp_path / "shards", masks=masks)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"data.train_shards={shards} {fix}.*views.allow_mask_mismatch=true"):
        quiet_run(tiny_config(run, *SHARDS, f"data.train_shards={shards}", f"views.mask_probability={p_m}"))
    assert not list(run.glob("checkpoint-*")) and not (run / "metrics.jsonl").exists()


def test_the_override_trains_as_configured_and_says_so(tmp_path, capsys):
    shards = _shard_set(tmp_path / "shards", masks=False)
    with one_torch_thread():
        from relicv2.pretrain.run import run_pretraining

        run_pretraining(tiny_config(tmp_path / "run", *SHARDS, f"data.train_shards={shards}",
                                    "views.mask_probability=0.1", "views.allow_mask_mismatch=true"))
    printed = capsys.readouterr().out
    assert "warning: data.train_shards=" in printed and "pretrain: 1 rank(s), each on cpu" in printed
    assert [r.get("masked_fraction") for r in _records(tmp_path / "run")] == [0.0] * 4  # 2 epochs of 2 steps


@pytest.mark.parametrize(("p_m", "applied"), [("1.0", [1.0] * 4), ("0.5", None)])
def test_the_masked_fraction_applied_is_logged(tmp_path, p_m, applied):
    shards = _shard_set(tmp_path / "shards", masks=True)
    with one_torch_thread():
        quiet_run(tiny_config(tmp_path / "run", *SHARDS, f"data.train_shards={shards}", f"views.mask_probability={p_m}"))
    fractions = [r["masked_fraction"] for r in _records(tmp_path / "run")]  # one record per step (log_every=1)
    if applied is not None:
        assert fractions == applied  # every large view of every sample: each mask covers 36%
    else:  # 2 large views x 8 images a step: a fraction in sixteenths, near p_m over the run
        assert all(f * 16 == int(f * 16) for f in fractions) and 0.2 < sum(fractions) / len(fractions) < 0.8


def test_the_report_shows_the_masking_applied_and_each_figures_protocol(tmp_path):
    from relicv2.evaluation.report.html import ReportInputs, build_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("views:\n  mask_probability: 0.1\nknn:\n  crop_size: 64\n  k: 20\n"
                                     "  temperature: 0.07\n  train_shards: sh/train\n  val_shards: sh/val\n"
                                     "derived:\n  steps_per_epoch: 2\n")
    steps = [{"step": s, "epoch": s / 2, "loss": 1.0, "masked_fraction": f} for s, f in
             ((1, 0.0), (2, 0.2), (3, 0.1), (4, 0.1))]
    knn = [{"step": 4, "knn_top1": 0.44}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + knn))
    evals = tmp_path / "evals"
    evals.mkdir()
    for name, size, top1 in (("knn-64.json", 64, 0.44), ("knn-224.json", 224, 0.34)):
        (evals / name).write_text(json.dumps({
            "protocol": "knn", "checkpoint": "run/checkpoint-4.pt", "top1": top1, "num_train": 10, "num_val": 5,
            "settings": {"image_size": size, "k": 20, "temperature": 0.07, "bank": "sh/train", "split": "sh/val"}}))
    build_report(ReportInputs(run_dir=run, eval_json=(evals,)), tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "masked fraction of large views per epoch (views.mask_probability 0.1): 1: 0.100, 2: 0.100" in page
    assert "at step 4 (64 px, k=20, T=0.07, bank train, split val)" in page
    assert "<td>64 px, k=20, T=0.07, bank train, split val</td>" in page
    assert "<td>224 px, k=20, T=0.07, bank train, split val</td>" in page


def test_a_knn_monitor_whose_queries_are_in_its_bank_is_refused(tmp_path):
    shards = _shard_set(tmp_path / "shards", masks=False)
    with pytest.raises(ConfigError, match=r"knn.train_shards and knn.val_shards share 2 tar\(s\) .*held-out"):
        quiet_run(tiny_config(tmp_path / "run", f"knn.train_shards={shards}", f"knn.val_shards={shards}"))
    assert not (tmp_path / "run").exists()


def test_eval_knn_refuses_a_bank_that_holds_its_queries(tmp_path):
    from click.testing import CliRunner

    from relicv2.cli.eval import eval_group

    shards = _shard_set(tmp_path / "shards", masks=False)
    result = CliRunner().invoke(eval_group, ["knn", "--random-init", "18", "--train", str(shards),
                                             "--val", str(shards / "images-000001.tar")])
    assert result.exit_code == 1 and "--train and --val share 1 tar(s) (images-000001.tar, ...)" in result.output


def test_a_knn_monitor_at_another_size_than_the_views_is_said(tmp_path, capsys):
    from relicv2.pretrain.run import check_before_starting

    train, val = _shard_set(tmp_path / "train", masks=False), _shard_set(tmp_path / "val", masks=False)
    config = tiny_config(tmp_path / "run", f"knn.train_shards={train}", f"knn.val_shards={val}", "knn.crop_size=32")
    check_before_starting(config, None)
    assert "warning: knn.crop_size=32 but the encoder trains on views.large_size=16 px views" in capsys.readouterr().out
    check_before_starting(tiny_config(tmp_path / "run", f"knn.train_shards={train}", f"knn.val_shards={val}",
                                      "knn.crop_size=16"), None)
    assert "warning" not in capsys.readouterr().out

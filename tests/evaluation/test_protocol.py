"""One answer per figure: `eval knn` of a checkpoint follows its training unless told otherwise, and
every kNN JSON records the protocol that gave it."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from click.testing import CliRunner

from relicv2.cli.eval import eval_group
from relicv2.pretrain.config import load_config, trained_protocol
from relicv2.pretrain.run import run_pretraining
from tests.threads import one_torch_thread


@pytest.fixture
def monitored_run(shape_shards, tmp_path):
    """A one-epoch run whose kNN monitor scored it at 16 px with k=3."""
    train, val = shape_shards
    config = load_config(None, [
        "data.source=synthetic", "data.synthetic_images=8", "model.depth=18", "model.hidden_dim=16",
        "model.out_dim=8", "views.large_views=2", "views.small_views=0", "views.large_size=16",
        "optim.global_batch=8", "optim.epochs=1", "optim.warmup_epochs=0", "loss.num_negatives=7",
        f"run.output_dir={tmp_path / 'run'}", "run.device=cpu", "run.progress_bar=false", "run.log_every=1",
        f"knn.train_shards={train}", f"knn.val_shards={val}", "knn.every_epochs=1", "knn.crop_size=16", "knn.k=3",
    ])
    with one_torch_thread(), contextlib.redirect_stdout(io.StringIO()):
        run_pretraining(config, auto_resume=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return tmp_path / "run", [r for r in records if "knn_top1" in r][-1]


def test_eval_knn_of_a_checkpoint_reproduces_its_runs_figure(monitored_run, shape_shards, tmp_path):
    run, monitor = monitored_run
    train, val = shape_shards
    out = tmp_path / "knn.json"
    with one_torch_thread():
        result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(run), "--train", str(train),
                                                 "--val", str(val), "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["settings"] == {"image_size": 16, "resize_size": 18, "k": 3, "temperature": 0.07,
                                  "bank": str(train), "split": str(val)}
    assert record["top1"] == pytest.approx(monitor["knn_top1"])
    assert "16 px, k=3" in result.output and "on cpu" in result.output and "the checkpoint's own protocol" in result.output


def test_an_image_size_the_encoder_was_not_scored_at_is_said(monitored_run, shape_shards, tmp_path):
    run, _ = monitored_run
    train, val = shape_shards
    out = tmp_path / "knn.json"
    with one_torch_thread():
        result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(run), "--train", str(train), "--val",
                                                 str(val), "--device", "cpu", "--crop-size", "32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning: the encoder was evaluated at 16 px" in result.output
    assert json.loads(out.read_text())["settings"]["image_size"] == 32


def test_a_run_without_a_monitor_is_scored_at_its_view_size():
    config = load_config(None, ["views.large_size=64"])
    assert trained_protocol(config) == {"crop_size": 64, "resize_size": 0}


def test_eval_linear_of_a_checkpoint_takes_its_image_size_unless_set(monitored_run, shape_shards, tmp_path):
    run, _ = monitored_run
    train, val = shape_shards
    sizes = []
    for extra in ([], ["--set", "crop_size=24"]):
        out = tmp_path / f"linear{len(extra)}.json"
        with one_torch_thread():
            result = CliRunner().invoke(eval_group, ["linear", "--checkpoint", str(run), "--train", str(train), "--val",
                                                     str(val), "--preset", "fast", "--set", "epochs=2", "--device",
                                                     "cpu", "--json", str(out), *extra])
        assert result.exit_code == 0, result.output
        config = json.loads(out.read_text())["config"]
        sizes.append((config["crop_size"], config["resize_size"]))
    assert sizes == [(16, 18), (24, 256)]  # the run's monitor size; a size that is set wins (resize as set: default)

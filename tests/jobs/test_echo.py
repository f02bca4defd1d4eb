"""Every job prints its resolved settings in one format (YAML, `jobs.config.settings_text`) at start
and saves the same text as config.yaml beside its outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.evaluation.job import load_linear_config
from relicv2.jobs.config import SETTINGS_FILE, to_dict
from relicv2.jobs.version import package_version
from relicv2.pretrain.config import load_config
from relicv2.saliency.network.config import load_saliency_config
from relicv2.shards import write_shard_set
from tests.evaluation.conftest import write_labelled_set
from tests.saliency.network.conftest import scene_samples

TINY_PRETRAIN = ["data.source=synthetic", "data.synthetic_images=16", "model.depth=18", "model.hidden_dim=16",
                 "model.out_dim=8", "views.large_views=2", "views.small_views=1", "views.large_size=16",
                 "views.small_size=8", "optim.global_batch=8", "knn.train_shards=", "knn.val_shards=",
                 "run.progress_bar=false", "run.device=cpu", "run.max_steps=1", "run.compile=false"]
TINY_SALIENCY = ["methods=mc", "num_images=4", "epochs=1", "fuse_epochs=1"]
FAST_LINEAR = ["epochs=2", "batch_size=8", "crop_size=32", "resize_size=36"]


def _sets(flag: str, values: list[str]) -> list[str]:
    return [arg for value in values for arg in (flag, value)]


def _echoed(output: str, saved: str) -> dict:
    """The saved settings, checked to be printed verbatim and to follow the one format."""
    assert saved in output, f"the printed settings differ from {SETTINGS_FILE}:\n{output}"
    assert saved.startswith(f"version: {package_version()}\n")
    return yaml.safe_load(saved)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("labelled")
    write_labelled_set(root / "train", 24, seed=1)
    write_labelled_set(root / "val", 12, seed=2)
    return root / "train", root / "val"


def test_pretrain_prints_and_saves_its_settings(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["pretrain", "--config", "demo-cpu", "--output", str(out),
                                      *_sets("--set", TINY_PRETRAIN)])
    assert result.exit_code == 0, result.output
    tree = _echoed(result.output, (out / SETTINGS_FILE).read_text())
    config = load_config("demo-cpu", [*TINY_PRETRAIN, f"run.output_dir={out}"])
    assert list(tree) == ["version", *to_dict(config), "derived"]
    printed = CliRunner().invoke(cli, ["pretrain", "--config", "demo-cpu", "--output", str(out), "--print-config",
                                       *_sets("--set", TINY_PRETRAIN)])
    assert printed.exit_code == 0 and yaml.safe_load(printed.output) == {
        k: v for k, v in tree.items() if k != "derived"}


@pytest.mark.usefixtures("one_thread")
def test_saliency_train_prints_and_saves_its_settings(tmp_path):
    samples, _ = scene_samples(4)
    write_shard_set(samples, tmp_path / "scenes")
    out = tmp_path / "net"
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(tmp_path / "scenes"), "--out", str(out),
                                      "--config", "tiny", "--backbone", "random", "--no-progress",
                                      *_sets("--set", TINY_SALIENCY)])
    assert result.exit_code == 0, result.output
    tree = _echoed(result.output, (out / SETTINGS_FILE).read_text())
    assert list(tree) == ["version", *to_dict(load_saliency_config("tiny", TINY_SALIENCY)), "inputs"]
    assert tree["inputs"] == {"shards": str(tmp_path / "scenes"), "backbone": "random"}


def test_eval_linear_prints_and_saves_its_settings(tmp_path, labelled):
    train, val = labelled
    out = tmp_path / "linear"
    result = CliRunner().invoke(cli, ["eval", "linear", "--random-init", "18", "--train", str(train), "--val",
                                      str(val), "--config", "fast", "--device", "cpu", "--output", str(out),
                                      *_sets("--set", FAST_LINEAR)])
    assert result.exit_code == 0, result.output
    tree = _echoed(result.output, (out / SETTINGS_FILE).read_text())
    assert list(tree) == ["version", *to_dict(load_linear_config("fast", FAST_LINEAR)), "inputs"]
    assert tree["protocol"] == "fast" and tree["inputs"]["train"] == str(train)
    assert tree["inputs"]["backbone"] == {"checkpoint": None, "random_init": 18, "network": "online", "seed": 0}


def test_eval_knn_prints_its_settings_in_the_same_format(tmp_path, labelled):
    train, val = labelled
    result = CliRunner().invoke(cli, ["eval", "knn", "--random-init", "18", "--train", str(train), "--val", str(val),
                                      "--crop-size", "32", "--k", "3", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    block = result.output[result.output.index("version: "):result.output.index("random-init ResNet-18: kNN")]
    tree = yaml.safe_load(block)
    assert tree["k"] == 3 and tree["crop_size"] == 32 and tree["inputs"]["val"] == str(val)
    assert block.startswith(f"version: {package_version()}\n")

"""`saliency build-masks` takes its settings like every job: presets by name or a YAML file, the options,
typed `--set`, one echo, and config.yaml beside the masked set."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.jobs.config import ConfigError
from relicv2.saliency.network.config import MASKS_PRESETS, load_masks_config


def _build_masks(tiny_model: Path, shards: Path, out: Path, *options: str):
    return CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(tiny_model), "--shards", str(shards),
                                    "--out", str(out), "--workers", "0", "--no-progress", *options])


def test_a_preset_the_options_and_set_are_echoed_and_saved_beside_the_set(tmp_path, scene_shards, tiny_model,
                                                                          monkeypatch):
    shards, _ = scene_shards
    monkeypatch.chdir(tmp_path)  # a preset is found by name from any directory
    out = tmp_path / "masked"
    result = _build_masks(tiny_model, shards, out, "--config", "cpu", "--batch", "8", "--set", "batch_size=4",
                          "--set", "merge_timeout_s=60", "--flip")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["device"], saved["batch_size"], saved["workers"], saved["merge_timeout_s"]) == ("cpu", 4, 0, 60.0)
    assert saved["flip"] is True
    assert saved["shards"] == str(shards) and saved["version"]
    assert (out / "config.yaml").read_text().rstrip() in result.output  # the echo is the saved text


def test_an_option_given_beats_the_preset_and_set_beats_both():
    config = load_masks_config("gpu", ["workers=3"], model=Path("m.pt"), shards=Path("in"), out=Path("o"),
                               device="cpu", workers=1, batch_size=None)
    assert (config.device, config.batch_size, config.workers) == ("cpu", 64, 3)
    assert isinstance(config.model, Path) and config.index_cache is None


def test_unknown_keys_presets_and_types_are_refused_in_one_line_before_any_work(tmp_path, scene_shards, tiny_model):
    shards, _ = scene_shards
    out = tmp_path / "masked"
    for options, message in [
        (["--set", "batchsize=4"], "unknown key batchsize; valid keys here are: batch_size, crf, device"),
        (["--config", "fast"], "unknown preset 'fast'; presets: cpu (This machine's cores"),
        (["--set", "batch_size=four"], "batch_size must be of type int, got 'four'"),
        (["--device", "tpu"], "--device tpu is not a device; use auto, cpu, cuda or cuda:N"),
    ]:
        result = _build_masks(tiny_model, shards, out, *options)
        assert result.exit_code == 1 and message in result.output, result.output
        assert result.output.count("\n") == 1 and not out.exists()
    assert MASKS_PRESETS.names() == ["cpu", "gpu"]
    with pytest.raises(ConfigError, match="model must be of type Path"):
        load_masks_config(None, ["model=[1]"], shards=Path("in"), out=Path("o"))

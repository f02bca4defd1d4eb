"""`relicv2 saliency train | build-masks | preview` from the command line: clear errors, masked previews."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.main import cli
from relicv2.jobs.config import ConfigError
from relicv2.saliency.network.config import load_saliency_config


def test_train_with_a_missing_backbone_is_one_clear_error(tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(tmp_path / "out"),
                                      "--preset", "tiny", "--backbone", str(tmp_path / "nope.pt")])
    assert result.exit_code != 0
    assert "nope.pt does not exist" in result.output and "Traceback" not in result.output


def test_unknown_setting_is_refused(tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(tmp_path / "o"),
                                      "--config", "tiny", "--backbone", "random", "--set", "epochz=3"])
    assert result.exit_code != 0 and "unknown key epochz; valid keys here are: " in result.output
    try:
        load_saliency_config("cpu", ["epochs=three"])
    except ConfigError as error:
        assert "epochs must be of type int" in str(error)
    else:
        raise AssertionError("a string for an int setting must be refused")


def test_negative_rounds_are_refused_and_zero_is_taken() -> None:
    with pytest.raises(ConfigError, match=r"iterations must be >= 0 \(0: the fused network on the handcrafted labels\)"):
        load_saliency_config("tiny", ["iterations=-1"])
    assert load_saliency_config("tiny", ["iterations=0"]).iterations == 0


def test_build_masks_and_preview_from_the_command_line(tmp_path: Path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    runner = CliRunner()
    out = tmp_path / "masked"
    result = runner.invoke(cli, ["saliency", "build-masks", "--model", str(tiny_model), "--shards", str(shards),
                                 "--out", str(out), "--batch", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "12 masked, 0 rejected" in result.output and "coverage" in result.output
    sheet = tmp_path / "sheet.png"
    result = runner.invoke(cli, ["saliency", "preview", "--input", str(out), "--output", str(sheet), "--count", "2"])
    assert result.exit_code == 0, result.output
    assert Image.open(sheet).size[1] > 2 * 160  # two rows: image | mask | background removed


def test_build_masks_with_a_foreign_model_file(tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"not a model")
    result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(bogus), "--shards", str(shards),
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and "model.pt is not a readable saliency model file (not a file written by torch.save)" in result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "o").exists()  # one line; a refused job leaves no --out

"""A backbone of another width or depth names the setting that fits it (read from the file's tensors),
and the saliency jobs say which device they run on (`device: auto` by default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.jobs.config import ConfigError
from relicv2.jobs.device import resolve_device
from relicv2.models.encoder_file import architecture_of
from relicv2.models.resnet import resnet
from relicv2.saliency.network.config import SaliencyTrainConfig

FAST = ["--preset", "tiny", "--no-progress", "--set", "methods=mc", "--set", "num_images=4",
        "--set", "epochs=1", "--set", "fuse_epochs=1"]


def _train(shards: Path, out: Path, backbone: str, *extra: str):
    return CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(out),
                                    "--backbone", backbone, *FAST, *extra])


@pytest.mark.parametrize(("depth", "width"), [(18, 1), (34, 1), (50, 1), (18, 2)])
def test_the_architecture_is_read_from_the_tensors(depth, width):
    with torch.device("meta"):  # shapes only: a wide ResNet-50 would take hundreds of MB
        state = resnet(depth, width).state_dict()
    assert architecture_of(state) == (depth, width)
    assert architecture_of({"weight": torch.zeros(3)}) is None


def test_a_swav_backbone_of_another_width_says_set_width(scene_shards, tmp_path):
    shards, _ = scene_shards
    # A SwAV-format file (`module.` names, a projection head) of a 2x ResNet-18 given at width 1:
    # the trunk's real names, the stem at 2x (all the width is read from), the rest at 1x to stay small.
    state = {f"module.{name}": value for name, value in resnet(18, 1).state_dict().items()}
    state["module.conv1.weight"] = torch.zeros(128, 3, 7, 7)
    state["module.projection_head.0.weight"] = torch.zeros(8, 8)
    torch.save({"state_dict": state, "epoch": 400}, tmp_path / "swav_rn18w2.pth")
    result = _train(shards, tmp_path / "out", str(tmp_path / "swav_rn18w2.pth"))
    assert result.exit_code != 0
    assert "holds a ResNet-18 at width 2 (read from its tensors)" in result.output
    assert "add --set width=2" in result.output and "module." not in result.output
    assert not (tmp_path / "out").exists()


def test_a_backbone_of_another_depth_says_set_depth(scene_shards, tmp_path):
    shards, _ = scene_shards
    torch.save(resnet(34, 1).state_dict(), tmp_path / "r34.pth")
    result = _train(shards, tmp_path / "out", str(tmp_path / "r34.pth"))
    assert result.exit_code != 0 and "add --set depth=34" in result.output and "width=" not in result.output


def test_device_auto_is_the_default_and_the_job_says_where_it_runs(scene_shards, tmp_path):
    shards, _ = scene_shards
    assert SaliencyTrainConfig().device == "auto"
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    result = _train(shards, tmp_path / "out", "random")
    assert result.exit_code == 0, result.output
    assert f"encoder from random initialisation, on {expected}" in result.output


def test_an_unknown_or_missing_device_is_refused():
    with pytest.raises(ConfigError, match="device=tpu is not a device; use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device=cuda: no CUDA device is visible; use cpu or auto"):
            resolve_device("cuda")


def test_a_backbone_made_for_another_padding_is_said(tmp_path):
    import json

    from relicv2.saliency.network.weights import encoder_state_dict

    path = tmp_path / "relicv2_r18.pt"
    torch.save(resnet(18, 1).state_dict(), path)
    path.with_name(path.name + ".json").write_text(json.dumps({"depth": 18, "width": 1, "format": "torchvision",
                                                               "padding": "same_tf"}))
    _, description = encoder_state_dict(path, 18, 1)
    assert "made for same_tf padding; the saliency encoder pads as torchvision does" in description
    path.with_name(path.name + ".json").write_text(json.dumps({"depth": 18, "width": 1, "format": "torchvision"}))
    assert "padding" not in encoder_state_dict(path, 18, 1)[1]

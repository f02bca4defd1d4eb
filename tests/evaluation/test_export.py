"""`relicv2 export`: torchvision-strict state dicts, sidecars, and exported files as backbones."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from click.testing import CliRunner

from relicv2.cli.eval import eval_group
from relicv2.cli.main import cli
from relicv2.jobs.config import to_dict
from relicv2.models.encoder_file import (
    ExportError,
    load_encoder_file,
    save_encoder_file,
    sidecar_path,
)
from relicv2.models.heads import build_networks
from relicv2.models.resnet import resnet
from relicv2.pretrain.checkpoint import encoder_from_checkpoint, save_checkpoint
from relicv2.pretrain.config import load_config


def _checkpoint(folder, depth=18, width=1):
    config = load_config(None, [f"model.depth={depth}", f"model.width={width}", "model.hidden_dim=16",
                                "model.out_dim=8"])
    torch.manual_seed(0)
    online, target = build_networks(depth, width, hidden_dim=16, out_dim=8)
    with torch.no_grad():  # non-trivial BN statistics, different online and target weights
        for module in online.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
        target.encoder.conv1.weight.mul_(0.5)
    save_checkpoint(folder, {"config": to_dict(config), "step": 7, "online": online.state_dict(),
                             "target": target.state_dict(), "optimizer": {}, "rng": [], "data": []}, keep=1)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 7, "knn_top1": 0.25}) + "\n")
    return folder / "checkpoint-000000007.pt"


def test_export_loads_strictly_into_torchvision_with_identical_features(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run")
    out = tmp_path / "r18.pt"
    result = CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "fc not included" in result.output
    state = torch.load(out, weights_only=True)
    reference = torchvision.models.resnet18()
    report = reference.load_state_dict(state, strict=False)
    assert sorted(report.missing_keys) == ["fc.bias", "fc.weight"] and not report.unexpected_keys
    reference.load_state_dict({**state, "fc.weight": reference.fc.weight, "fc.bias": reference.fc.bias}, strict=True)
    reference.fc = torch.nn.Identity()
    ours = encoder_from_checkpoint(checkpoint).eval()
    images = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(reference.eval()(images), ours(images))
        assert torch.equal(load_encoder_file(out).eval()(images), ours(images))
    sidecar = json.loads(sidecar_path(out).read_text())
    assert sidecar["format"] == "torchvision" and sidecar["arch"] == "resnet18"
    assert (sidecar["depth"], sidecar["width"], sidecar["step"], sidecar["network"]) == (18, 1, 7, "online")
    assert sidecar["config_summary"]["model"] == {"depth": 18, "width": 1}
    assert sidecar["figures"]["knn_top1"] == 0.25


def test_sidecar_figures_are_the_checkpoints_own(tmp_path):
    """kNN: the last record at or before the checkpoint's step; linear: the trained encoder's, not its baseline."""
    _checkpoint(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "knn_top1": s / 10})
                                                               for s in (5, 7, 9)) + '\n{"step": 8, "knn')
    for name, random_init, top1 in (("linear", None, 0.75), ("linear_random", 18, 0.25)):
        (tmp_path / "run" / f"{name}.json").write_text(json.dumps(
            {"protocol": "linear-fast", "random_init": random_init, "top1": top1}))
    out = tmp_path / "r18.pt"
    result = CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(sidecar_path(out).read_text())["figures"]
    assert figures == {"knn_top1": 0.7, "knn_step": 7, "linear-fast_top1": 0.75}


def test_target_network_and_wide_encoders_use_this_projects_format(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", depth=18, width=2)
    out = tmp_path / "wide.pt"
    result = CliRunner().invoke(cli, ["export", "--checkpoint", str(checkpoint), "--out", str(out),
                                      "--network", "target"])
    assert result.exit_code == 0, result.output
    sidecar = json.loads(sidecar_path(out).read_text())
    assert sidecar["format"] == "relicv2" and sidecar["width"] == 2 and sidecar["network"] == "target"
    images = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        expected = encoder_from_checkpoint(checkpoint, network="target").eval()(images)
        assert torch.equal(load_encoder_file(out).eval()(images), expected)


def test_broken_exports_give_one_clear_error(tmp_path):
    encoder = resnet(18)
    out = tmp_path / "e.pt"
    save_encoder_file(encoder, out, depth=18, width=1)
    sidecar_path(out).write_text(json.dumps({"format": "torchvision", "depth": 34, "width": 1}))
    with pytest.raises(ExportError, match="does not fit a ResNet-34"):
        load_encoder_file(out)
    sidecar_path(out).unlink()
    with pytest.raises(ExportError, match="has no sidecar"):
        load_encoder_file(out)
    with pytest.raises(ExportError, match="does not exist"):
        load_encoder_file(tmp_path / "missing.pt")


def test_an_exported_file_feeds_eval_knn_and_eval_linear(tmp_path, shape_shards):
    _checkpoint(tmp_path / "run")
    out = tmp_path / "r18.pt"
    assert CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]).exit_code == 0
    train, val = shape_shards
    knn = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(out), "--train", str(train), "--val", str(val),
                                          "--crop-size", "32", "--device", "cpu"])
    assert knn.exit_code == 0, knn.output
    assert "kNN top-1" in knn.output and "72 train" in knn.output
    record = tmp_path / "linear.json"
    linear = CliRunner().invoke(eval_group, ["linear", "--checkpoint", str(out), "--train", str(train), "--val",
                                             str(val), "--preset", "fast", "--set", "epochs=3", "--set",
                                             "crop_size=32", "--json", str(record), "--device", "cpu"])
    assert linear.exit_code == 0, linear.output
    payload = json.loads(record.read_text())
    assert payload["checkpoint"] == str(out) and payload["step"] == 7 and payload["protocol"] == "linear-fast"


def test_same_tf_padding_pads_strided_layers_after_more_than_before():
    from relicv2.models.resnet import _same_tf_pads

    assert _same_tf_pads(224, 7, 2) == (2, 3)  # TF: out 112, total pad 5 -> 2 before, 3 after
    assert _same_tf_pads(112, 3, 2) == (0, 1)
    assert _same_tf_pads(57, 3, 2) == (1, 1)
    assert _same_tf_pads(56, 1, 2) == (0, 0)
    torch_mode, tf_mode = resnet(18), resnet(18, padding="same_tf")
    tf_mode.load_state_dict(torch_mode.state_dict())  # same names and shapes in both modes
    x = torch.randn(1, 3, 32, 32)  # even sizes: SAME pads asymmetrically (odd ones symmetrically)
    with torch.no_grad():
        assert tf_mode.eval()(x).shape == torch_mode.eval()(x).shape == (1, 512)
        assert not torch.allclose(tf_mode(x), torch_mode(x))  # the padding really differs
    # a 1-pixel shift of the input is what "more padding after" means for the stem
    conv = tf_mode.conv1
    image = torch.randn(1, 3, 8, 8)
    expected = torch.nn.functional.conv2d(torch.nn.functional.pad(image, (2, 3, 2, 3)), conv.weight, stride=2)
    assert torch.allclose(conv(image), expected)
    with pytest.raises(ValueError, match="padding must be one of"):
        resnet(18, padding="valid")

"""`relicv2 export --format safetensors|hf-folder`: files torchvision and timm load with this project's
features, a model card with the run's figures, and safetensors files the loader reads or refuses in one line."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import torchvision
from click.testing import CliRunner

from relicv2.cli.eval import eval_group
from relicv2.cli.main import cli
from relicv2.evaluation.export import load_backbone
from relicv2.models.encoder_file import ExportError, load_encoder_file, save_encoder_file
from relicv2.models.resnet import resnet
from relicv2.pretrain.checkpoint import encoder_from_checkpoint
from tests.evaluation.test_export import _checkpoint


def _export(*args):
    result = CliRunner().invoke(cli, ["export", *map(str, args)])
    return result.exit_code, result.output


def _features(model, images):
    with torch.no_grad():
        return model.eval()(images)


def _torchvision(depth, state):
    model = getattr(torchvision.models, f"resnet{depth}")()
    model.fc = torch.nn.Identity()
    model.load_state_dict(state, strict=True)  # every entry used, none missing
    return model


def test_safetensors_export_holds_no_pickle_and_loads_in_torchvision_with_identical_features(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run")
    out = tmp_path / "r18.safetensors"
    code, output = _export("--checkpoint", tmp_path / "run", "--out", out)  # the format follows the name
    assert code == 0, output
    assert f"wrote {out}: torchvision names, resnet18" in output and not (tmp_path / "r18.safetensors.json").exists()
    raw = out.read_bytes()
    assert raw[8:9] == b"{" and b"PK\x03\x04" not in raw[:4]  # a JSON header, not torch's zip of pickles
    with safetensors.safe_open(out, "pt") as file:
        metadata = file.metadata()
    sidecar = json.loads(metadata["relicv2"])
    assert metadata["format"] == "pt" and (sidecar["arch"], sidecar["step"], sidecar["network"]) == ("resnet18", 7, "online")
    assert sidecar["figures"]["knn_top1"] == 0.25 and sidecar["config_summary"]["model"] == {"depth": 18, "width": 1}
    images = torch.randn(2, 3, 48, 48)
    expected = _features(encoder_from_checkpoint(checkpoint), images)
    assert torch.equal(_features(_torchvision(18, safetensors.torch.load_file(out)), images), expected)
    assert torch.equal(_features(load_encoder_file(out), images), expected)
    encoder, record = load_backbone(out)
    assert record["format"] == "export-torchvision-safetensors" and record["step"] == 7
    assert torch.equal(_features(encoder, images), expected)


@pytest.mark.parametrize("depth", [18, 50])
def test_safetensors_weights_load_in_timm_by_name_with_identical_features(tmp_path, depth, monkeypatch):
    timm = pytest.importorskip("timm", reason="timm is a test-only extra (requirements-dev.lock)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a load that tried the hub would fail, not download
    torch.manual_seed(depth)
    ours = resnet(depth)
    with torch.no_grad():  # BN statistics that are not the defaults, so a skipped buffer shows
        for module in ours.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
    out = tmp_path / "e.safetensors"
    save_encoder_file(ours, out, depth=depth, width=1)
    model = timm.create_model(f"resnet{depth}", pretrained=True, num_classes=0,
                              pretrained_cfg_overlay=dict(file=str(out)))
    images = torch.randn(2, 3, 40, 40)
    expected = _features(ours, images)
    assert torch.equal(_features(model, images), expected)
    assert torch.equal(_features(_torchvision(depth, safetensors.torch.load_file(out)), images), expected)


def test_hub_folder_loads_in_timm_and_every_eval_with_the_runs_figures_in_its_card(tmp_path, shape_shards,
                                                                                   monkeypatch):
    checkpoint = _checkpoint(tmp_path / "run")
    run = tmp_path / "run"
    results = (("linear", None, "linear-fast", 0.75), ("linear_random", 18, "linear-fast", 0.125),
               ("finetune", None, "finetune-1pct", 0.5), ("knn", None, "knn", 0.375))
    for name, random_init, protocol, top1 in results:
        (run / f"{name}.json").write_text(json.dumps({"protocol": protocol, "random_init": random_init, "top1": top1}))
    hub = tmp_path / "hub" / "r18"
    code, output = _export("--checkpoint", run, "--out", hub, "--format", "hf-folder")
    assert code == 0, output
    assert sorted(path.name for path in hub.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = (hub / "README.md").read_text()
    for row in ("| kNN monitor (step 7) top-1 | 25.0% |", "| linear-fast top-1 | 75.0% |",
                "| finetune-1pct top-1 | 50.0% |", "| knn-eval top-1 | 37.5% |"):
        assert row in card, card
    assert "12.5%" not in card  # the random-init baseline is not this encoder's figure
    assert "license: unknown" in card and "ResNet-18, width 1x, 512 features" in card
    assert "pretrained_cfg_overlay=dict(file='FOLDER/model.safetensors')" in card
    config = json.loads((hub / "config.json").read_text())
    assert (config["architecture"], config["num_classes"], config["num_features"]) == ("resnet18", 0, 512)
    assert config["pretrained_cfg"]["input_size"] == [3, 224, 224] and config["pretrained_cfg"]["first_conv"] == "conv1"
    assert config["relicv2"]["step"] == 7
    images = torch.randn(2, 3, 48, 48)
    expected = _features(encoder_from_checkpoint(checkpoint), images)
    assert torch.equal(_features(load_backbone(hub)[0], images), expected)  # the folder stands for its weights
    timm = pytest.importorskip("timm", reason="timm is a test-only extra (requirements-dev.lock)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = timm.create_model(f"local-dir:{hub}", pretrained=True)  # config.json says: no classifier
    assert torch.equal(_features(model, images), expected)
    train, val = shape_shards
    knn = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(hub), "--train", str(train), "--val", str(val),
                                          "--crop-size", "32", "--device", "cpu"])
    assert knn.exit_code == 0 and "kNN top-1" in knn.output, knn.output


def test_wide_encoders_say_that_only_relicv2_loads_them(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", depth=18, width=2)
    hub = tmp_path / "hub"
    code, output = _export("--checkpoint", checkpoint, "--out", hub, "--format", "hf-folder")
    assert code == 0, output
    assert "a 2x-wide encoder: only relicv2 loads it" in output and "wide_resnet50_2" in output
    assert "only relicv2 loads it" in (hub / "README.md").read_text()
    assert json.loads((hub / "config.json").read_text())["architecture"] == "relicv2_resnet18_2x"  # no timm model
    images = torch.randn(2, 3, 40, 40)
    assert torch.equal(_features(load_encoder_file(hub / "model.safetensors"), images),
                       _features(encoder_from_checkpoint(checkpoint), images))


def test_the_commands_formats_are_the_exports():
    from relicv2.cli.export import FORMATS
    from relicv2.evaluation.export import EXPORT_FORMATS

    assert FORMATS == EXPORT_FORMATS


def test_out_and_format_that_disagree_are_refused_before_the_checkpoint_is_read(tmp_path):
    def refused(out, fmt, match, checkpoint=tmp_path / "no-run"):  # a missing run: each refusal comes first
        code, output = _export("--checkpoint", checkpoint, "--out", out, "--format", fmt)
        assert code != 0 and match in output and len(output.strip().splitlines()) == 1, output

    refused(tmp_path / "e.pt", "safetensors", "does not fit --format safetensors: name it e.safetensors")
    refused(tmp_path / "e.safetensors", "torchvision", "add --format safetensors, or name it .pt")
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", "hf-folder", "is a file, not a folder")
    _checkpoint(tmp_path / "run")
    refused(tmp_path / "run", "hf-folder", "holds pretraining checkpoints", checkpoint=tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()


def _one_line_refusal(path, match):
    with pytest.raises(ExportError, match=match) as caught:
        load_backbone(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_truncated_foreign_or_unmarked_safetensors_files_get_one_line(tmp_path, shape_shards):
    good = tmp_path / "good.safetensors"
    save_encoder_file(resnet(18), good, depth=18, width=1)
    raw = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) - 1000])
    _one_line_refusal(truncated, "is truncated: its header describes")
    cut_in_header = tmp_path / "cut.safetensors"
    cut_in_header.write_bytes(raw[:100])
    _one_line_refusal(cut_in_header, "header length does not fit")
    torch_file = tmp_path / "torch.safetensors"  # a torch zip under the name
    torch.save(resnet(18).state_dict(), torch_file)
    _one_line_refusal(torch_file, "is not a safetensors file")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((20).to_bytes(8, "little") + b"not json at all....." + b"\0" * 50)
    _one_line_refusal(garbage, "its header is not a JSON object")
    foreign = tmp_path / "foreign.safetensors"  # a valid file of something else, no relicv2 metadata
    safetensors.torch.save_file({"embeddings.weight": torch.zeros(4, 2)}, foreign)
    _one_line_refusal(foreign, "without relicv2 metadata whose tensors are not a torchvision ResNet's")
    bad_metadata = tmp_path / "meta.safetensors"
    safetensors.torch.save_file(resnet(18).state_dict(), bad_metadata, metadata={"relicv2": "{not json"})
    _one_line_refusal(bad_metadata, "its 'relicv2' metadata is not JSON")
    # recognised by content too: the same truncated bytes under another name
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(truncated.read_bytes())
    _one_line_refusal(renamed, "is truncated")
    train, val = shape_shards
    result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(truncated), "--train", str(train),
                                             "--val", str(val), "--crop-size", "32", "--device", "cpu"])
    assert result.exit_code != 0 and "is truncated" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_plain_torchvision_safetensors_file_is_read_by_its_shapes_and_only_as_online(tmp_path):
    """Without relicv2 metadata (timm's or torchvision's weights saved as safetensors) the names and shapes fix
    the network: read as a torchvision ResNet, fc ignored; the target network it cannot claim to hold."""
    torch.manual_seed(0)
    reference = torchvision.models.resnet34()
    plain = tmp_path / "resnet34.safetensors"
    safetensors.torch.save_file(reference.state_dict(), plain)  # fc included, as timm and torchvision save it
    encoder, record = load_backbone(plain)
    reference.fc = torch.nn.Identity()
    images = torch.randn(1, 3, 40, 40)
    assert torch.equal(_features(encoder, images), _features(reference, images))
    assert record["format"] == "export-torchvision-safetensors" and record["step"] is None
    with pytest.raises(ExportError, match="holding the online network only"):
        load_backbone(plain, network="target")

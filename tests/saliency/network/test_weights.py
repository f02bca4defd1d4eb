"""Encoder weights: this project's checkpoints, torchvision and SwAV state dicts, export files; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from relicv2.models.encoder_file import save_encoder_file
from relicv2.models.resnet import resnet
from relicv2.pretrain.checkpoint import save_checkpoint
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.weights import BackboneError, encoder_state_dict, load_fitting


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def source() -> dict:
    torch.manual_seed(1)
    return resnet(18).state_dict()


def test_torchvision_state_dict_loads(tmp_path: Path, source: dict) -> None:
    path = tmp_path / "tv.pth"
    torch.save({**source, "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}, path)
    net = SaliencyNet(18)
    load_fitting(net.encoder, encoder_state_dict(path, 18, 1)[0], path, 18, 1)
    assert _same(net.encoder.state_dict(), source)


def test_swav_checkpoint_loads(tmp_path: Path, source: dict) -> None:
    state = {f"module.{k}": v for k, v in source.items()}
    state["module.projection_head.0.weight"] = torch.zeros(2048, 512)
    state["module.prototypes.weight"] = torch.zeros(3000, 128)
    path = tmp_path / "swav.pth.tar"
    torch.save({"epoch": 800, "state_dict": state}, path)
    loaded, kind = encoder_state_dict(path, 18, 1)
    assert "SwAV" in kind
    assert _same(loaded, source)


def test_pretrain_run_folder_loads(tmp_path: Path, source: dict) -> None:
    online = {f"encoder.{k}": v for k, v in source.items()} | {"projector.0.weight": torch.zeros(4, 4)}
    save_checkpoint(tmp_path / "run", {"config": {}, "step": 7, "online": online, "target": {}, "optimizer": {},
                                       "rng": [], "data": []}, keep=2)
    loaded, kind = encoder_state_dict(tmp_path / "run", 18, 1)
    assert "pretrain checkpoint" in kind and kind.endswith("checkpoint-000000007.pt")
    assert _same(loaded, source)


def test_export_sidecar_is_checked(tmp_path: Path, source: dict) -> None:
    path = tmp_path / "encoder.pt"
    torch.save(source, path)
    (tmp_path / "encoder.pt.json").write_text(json.dumps({"arch": "resnet", "depth": 18, "width": 1}))
    assert _same(encoder_state_dict(path, 18, 1)[0], source)
    with pytest.raises(BackboneError, match=r"ResNet-18 at width 1 .*ResNet-50"):
        encoder_state_dict(path, 50, 1)


def test_safetensors_files_and_an_imported_release_load(tmp_path: Path, source: dict) -> None:
    path = tmp_path / "encoder.safetensors"
    encoder = resnet(18)
    encoder.load_state_dict(source)
    save_encoder_file(encoder, path, depth=18, width=1)
    loaded, kind = encoder_state_dict(path, 18, 1)
    assert kind == f"safetensors file {path}" and _same(loaded, source)
    with pytest.raises(BackboneError, match=r"ResNet-18 at width 1 \(per the 'relicv2' metadata.*ResNet-50"):
        encoder_state_dict(path, 50, 1)
    marked = tmp_path / "release.pt"  # the authors' weights after import-official: marked for TF padding
    save_encoder_file(resnet(18, padding="same_tf"), marked, depth=18, width=1)
    state, kind = encoder_state_dict(marked, 18, 1)
    assert "made for same_tf padding" in kind
    load_fitting(SaliencyNet(18).encoder, state, marked, 18, 1)  # the marker is no weight
    plain = tmp_path / "timm.safetensors"  # no metadata, a classifier: timm's or torchvision's weights
    safetensors.torch.save_file({**source, "fc.weight": torch.zeros(10, 512), "fc.bias": torch.zeros(10)}, plain)
    assert _same(encoder_state_dict(plain, 18, 1)[0], source)
    plain.write_bytes(plain.read_bytes()[:-10])
    with pytest.raises(BackboneError, match="is truncated"):
        encoder_state_dict(plain, 18, 1)


def test_wrong_architecture_names_the_keys(tmp_path: Path, source: dict) -> None:
    path = tmp_path / "r18.pth"
    torch.save(source, path)
    with pytest.raises(BackboneError, match=r"r18\.pth does not fit a ResNet-50 at width 1: it holds a ResNet-18 at "
                                            r"width 1 \(read from its tensors\); add --set depth=18$"):
        load_fitting(SaliencyNet(50).encoder, encoder_state_dict(path, 50, 1)[0], path, 50, 1)


def test_corrupt_and_foreign_files(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(BackboneError, match=r"corrupt\.pt is not a readable weights file"):
        encoder_state_dict(corrupt, 18, 1)
    foreign = tmp_path / "foreign.pt"
    torch.save({"epoch": 3, "notes": "hello"}, foreign)
    with pytest.raises(BackboneError, match=r"foreign\.pt holds no weight tensors"):
        encoder_state_dict(foreign, 18, 1)
    with pytest.raises(BackboneError, match=r"does not exist"):
        encoder_state_dict(tmp_path / "missing.pt", 18, 1)
    with pytest.raises(BackboneError, match=r"no checkpoint-\*\.pt"):
        encoder_state_dict(tmp_path, 18, 1)


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pt"
    torch.save({"conv1.weight": Evil()}, path)
    with pytest.raises(BackboneError, match="not a readable weights file"):
        encoder_state_dict(path, 18, 1)

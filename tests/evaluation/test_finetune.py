"""Label splits (`relicv2 shards subset`) and semi-supervised fine-tuning."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import relicv2.evaluation.finetune as ft
from relicv2.cli.eval import eval_group
from relicv2.cli.shards import shards_group
from relicv2.evaluation.finetune import finetune
from relicv2.evaluation.job import load_finetune_config
from relicv2.shards.subset import class_balanced_keys, read_key_list
from tests.evaluation.conftest import NUM_CLASSES


def test_subset_is_class_balanced_seeded_and_written_by_the_cli(shape_shards, tmp_path):
    train, _ = shape_shards  # 72 images (12 per class) and one corrupt JPEG (class 0)
    half = class_balanced_keys(train, 0.5, seed=1)
    assert sorted(half.per_class) == list(range(NUM_CLASSES))
    assert all(6 <= count <= 7 for count in half.per_class.values())
    assert half.keys == class_balanced_keys(train, 0.5, seed=1).keys
    assert half.keys != class_balanced_keys(train, 0.5, seed=2).keys
    tiny = class_balanced_keys(train, 0.01)
    assert tiny.per_class == dict.fromkeys(range(NUM_CLASSES), 1)  # never a class without labels
    with pytest.raises(ValueError, match="fraction"):
        class_balanced_keys(train, 0)
    out = tmp_path / "split.txt"
    result = CliRunner().invoke(shards_group, ["subset", str(train), "--fraction", "0.5", "--seed", "1",
                                               "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_key_list(out) == set(half.keys)
    assert out.read_text().startswith("# relicv2 shards subset")
    (tmp_path / "bad.txt").write_text("../etc/passwd\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        read_key_list(tmp_path / "bad.txt")


def test_subset_of_plain_webdataset_tars_by_brace_pattern_matches_the_manifest_split(shape_shards, tmp_path):
    train, _ = shape_shards
    plain = tmp_path / "plain"
    plain.mkdir()
    tars = sorted(train.glob("*.tar"))
    for tar in tars:  # the same tars without manifest or index files
        shutil.copy(tar, plain / tar.name)
    stem = tars[0].name.rsplit("-", 1)[0]
    first, last = (t.name.rsplit("-", 1)[1].removesuffix(".tar") for t in (tars[0], tars[-1]))
    pattern = str(plain / f"{stem}-{{{first}..{last}}}.tar")
    split = class_balanced_keys(pattern, 0.5, seed=1, index_cache=tmp_path / "cache")
    assert split == class_balanced_keys(train, 0.5, seed=1)  # labels read from the cls members
    assert sorted(p.name for p in plain.iterdir()) == [t.name for t in tars]  # nothing written beside them

    import webdataset as wds

    named = tmp_path / "named"
    named.mkdir()
    with wds.ShardWriter(str(named / "train-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(6):  # class names where indices belong (images are not read)
            sink.write({"__key__": f"n{i}", "jpg": b"\xff\xd8 not decoded", "cls": ("tench", "church")[i % 2].encode()})
    result = CliRunner().invoke(shards_group, ["subset", str(named), "--fraction", "0.5", "--out", str(tmp_path / "x"),
                                               "--index-cache", str(tmp_path / "cache")])
    assert result.exit_code == 1 and "no labelled samples (no cls member holding a class index)" in result.output


class SmallNet(nn.Module):
    """A trainable stand-in encoder (conv - BN - ReLU - 4x4 pool)."""

    num_features = 128

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).flatten(1)


CONFIG = dataclasses.replace(load_finetune_config("10pct"), epochs=6, milestones=(4, 5), batch_size=12,
                             head_lr=0.3, encoder_lr=0.05, reference_batch=12, crop_size=32, resize_size=36,
                             crop_scale=(0.6, 1.0), workers=0)


def test_finetune_trains_encoder_and_head_on_the_listed_keys_and_resumes(shape_shards, tmp_path, monkeypatch):
    train, val = shape_shards
    keys = set(class_balanced_keys(train, 0.5, seed=0).keys)
    torch.manual_seed(0)
    encoder = SmallNet()
    before = encoder.body[0].weight.detach().clone()
    result = finetune(encoder, train, val, keys, CONFIG, output_dir=tmp_path / "whole")
    assert result.protocol == "finetune-10pct" and result.num_val == 36
    assert result.num_train + result.skipped == len(keys)  # a listed corrupt image is counted as skipped
    assert result.top1 >= 0.6  # chance is 1/6
    assert not torch.equal(before, encoder.body[0].weight)  # the encoder is trained, not frozen
    rates = ft.learning_rates(CONFIG, steps_per_epoch=3)  # (head, encoder) lr at a global step
    assert rates(11) == pytest.approx([0.3, 0.05]) and rates(12) == pytest.approx([0.06, 0.01])  # milestones: epochs 4 and 5
    assert rates(15) == pytest.approx([0.012, 0.002])
    real_loader, calls = ft.epoch_batches, Counter()

    def dying_loader(dataset, epoch, **options):
        calls["train"] += dataset.train
        if dataset.train and calls["train"] == 4:
            raise KeyboardInterrupt
        return real_loader(dataset, epoch, **options)

    monkeypatch.setattr(ft, "epoch_batches", dying_loader)
    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        finetune(SmallNet(), train, val, keys, CONFIG, output_dir=tmp_path / "resumed")
    monkeypatch.setattr(ft, "epoch_batches", real_loader)
    torch.manual_seed(0)
    resumed = finetune(SmallNet(), train, val, keys, CONFIG, output_dir=tmp_path / "resumed")
    assert resumed.top1 == result.top1 and resumed.per_class_top1 == result.per_class_top1


def test_finetune_cli_writes_the_json_contract(shape_shards, tmp_path):
    train, val = shape_shards
    split = tmp_path / "split.txt"
    assert CliRunner().invoke(shards_group, ["subset", str(train), "--fraction", "0.2", "--out",
                                             str(split)]).exit_code == 0
    out = tmp_path / "ft.json"
    result = CliRunner().invoke(eval_group, [
        "finetune", "--random-init", "18", "--train", str(train), "--val", str(val), "--labels", str(split),
        "--preset", "1pct", "--set", "epochs=1", "--set", "batch_size=8", "--set", "crop_size=32",
        "--set", "resize_size=32", "--set", "workers=0", "--json", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["protocol"] == "finetune-1pct" and record["random_init"] == 18
    assert record["num_train"] == len(read_key_list(split)) and record["num_val"] == 36
    assert record["top5"] is not None and 0 <= record["top1"] <= 1
    missing = CliRunner().invoke(eval_group, ["finetune", "--random-init", "18", "--train", str(train), "--val",
                                              str(val), "--labels", str(tmp_path / "nope.txt")])
    assert missing.exit_code != 0 and "does not exist" in missing.output


@pytest.mark.parametrize(("setting", "message"), [
    ("crop_scale=[0.5,0.1]", "crop_scale must satisfy 0 < lo <= hi <= 1"),
    ("crop_scale=[0,1]", "crop_scale must satisfy 0 < lo <= hi <= 1"),
    ("reference_batch=0", "reference_batch must be positive"),
    ("momentum=1.5", "momentum in \\[0, 1\\)"),
    ("weight_decay=-1", "weight_decay >= 0"),
])
def test_settings_out_of_range_are_refused_naming_the_setting(setting, message):
    with pytest.raises(ValueError, match=message):
        load_finetune_config("1pct", [setting])

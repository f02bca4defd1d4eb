"""The trained head file of `eval linear`: written by both protocols, scores its val set as the run did, and is
refused for another encoder or another class list; a restricted class subset scores among its classes only."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from relicv2.evaluation.head_file import (
    TRAINED_HEAD_FILE,
    HeadMismatchError,
    load_head,
    save_head,
    score_head,
)
from relicv2.evaluation.linear import LinearConfig, evaluate_linear
from relicv2.shards import resolve_shard_set
from relicv2.shards.outdir import INFO_NAME
from tests.evaluation.conftest import NUM_CLASSES, PooledPixels

FAST = LinearConfig(protocol="fast", epochs=30, batch_size=16, crop_size=32, resize_size=36)
PAPER = LinearConfig(protocol="paper", epochs=4, batch_size=24, base_lr=2.0, crop_size=32, resize_size=36,
                     crop_scale=(0.6, 1.0), workers=0, backend="pil")


class ScaledPixels(PooledPixels):
    """PooledPixels times a weight: encoders that differ only in their weights."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _named(source, folder, classes):
    shutil.copytree(source, folder)
    (folder / INFO_NAME).write_text(json.dumps({"classes": classes}))
    return folder


@pytest.mark.parametrize("config", [FAST, PAPER], ids=["fast", "paper"])
def test_both_protocols_write_a_head_that_scores_the_val_set_as_the_run_did(shape_shards, tmp_path, config):
    train, val = shape_shards
    encoder = ScaledPixels(1.0)
    result = evaluate_linear(encoder, train, val, config, output_dir=tmp_path)
    head = load_head(tmp_path / TRAINED_HEAD_FILE)
    assert head.protocol == config.name and head.num_classes == NUM_CLASSES and head.classes == []
    assert (head.crop_size, head.resize_size) == (32, 36)
    assert head.normalisation == ("standardised" if config.protocol == "fast" else "none")
    if config.protocol == "paper":
        assert torch.equal(head.mean, torch.zeros(48)) and torch.equal(head.std, torch.ones(48))
    scored = score_head(head, encoder, resolve_shard_set(val))
    assert scored.top1 == pytest.approx(result.top1) and scored.num_images == 36
    assert scored.per_class_top1 == pytest.approx(result.per_class_top1)


def test_a_head_from_another_encoder_or_class_list_is_refused(shape_shards, tmp_path):
    train, val = shape_shards
    names = [f"c{i}" for i in range(NUM_CLASSES)]
    named_train, named_val = (_named(s, tmp_path / n, names) for s, n in ((train, "train"), (val, "val")))
    evaluate_linear(ScaledPixels(1.0), named_train, named_val, FAST, output_dir=tmp_path / "out")
    head = load_head(tmp_path / "out" / TRAINED_HEAD_FILE)
    assert head.classes == names
    assert score_head(head, ScaledPixels(1.0), resolve_shard_set(named_val)).top1 >= 0.9
    with pytest.raises(HeadMismatchError, match="trained on another encoder") as error:
        score_head(head, ScaledPixels(1.5), resolve_shard_set(named_val), encoder_name="runs/other")
    assert "runs/other" in str(error.value) and "\n" not in str(error.value)
    other = _named(val, tmp_path / "other", [*names[:2], "zebra", *names[3:]])
    with pytest.raises(HeadMismatchError, match="class 2 is 'zebra' there, 'c2' in the head"):
        score_head(head, ScaledPixels(1.0), resolve_shard_set(other))
    (tmp_path / "foreign.pt").write_bytes(b"not torch")
    with pytest.raises(HeadMismatchError, match="foreign.pt is not a readable linear head file"):
        load_head(tmp_path / "foreign.pt")


def test_a_class_subset_is_scored_among_its_classes_only(shape_shards, tmp_path, monkeypatch):
    """A 3-way head scored on a 2-class set mapped to its outputs 0 and 2: output 1 is never predicted."""
    import relicv2.evaluation.head_file as head_file
    from relicv2.evaluation.features import FeatureSet

    encoder = ScaledPixels(1.0)
    linear = nn.Linear(3, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(3))
        linear.bias.zero_()
    save_head(tmp_path / "h.pt", linear, encoder=encoder, classes=["a", "b", "c"], mean=None, std=None,
              crop_size=8, resize_size=8, protocol="linear-fast")
    head = load_head(tmp_path / "h.pt")
    features = torch.tensor([[1.0, 5.0, 0.0], [0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    monkeypatch.setattr(head_file, "cached_features", lambda *a, **k: FeatureSet(features, torch.tensor([0, 1, 1])))
    # the set's 2 classes are the head's outputs 0 ("a") and 2 ("c")
    scored = score_head(head, encoder, resolve_shard_set(shape_shards[1]), targets=[[0], [2]])
    assert scored.predictions.tolist() == [0, 2, 0]
    assert scored.top1 == pytest.approx(2 / 3) and scored.per_class_top1 == {0: 1.0, 1: 0.5}
    unrestricted = score_head(head, encoder, resolve_shard_set(shape_shards[1]), targets=[[0, 1, 2], [2]])
    assert unrestricted.predictions.tolist() == [1, 1, 0] and unrestricted.top1 == pytest.approx(1 / 3)
    with pytest.raises(HeadMismatchError, match="beyond the 1 classes"):
        score_head(head, encoder, resolve_shard_set(shape_shards[1]), targets=[[0]])

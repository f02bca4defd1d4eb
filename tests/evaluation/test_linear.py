"""Linear evaluation: accuracy on separable classes, chance on shuffled labels, top-k, resume, ranks, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import relicv2.evaluation.linear as linear
from relicv2.cli.eval import eval_group
from relicv2.evaluation.features import FeatureSet, FeatureSpec, cache_path, cached_features
from relicv2.evaluation.linear import (
    LinearConfig,
    accuracy_report,
    evaluate_linear,
    train_linear_on_features,
)
from relicv2.evaluation.supervised import HeadCheckpointError
from relicv2.pretrain.distributed import init, teardown
from relicv2.shards import resolve_shard_set
from tests.evaluation.conftest import NUM_CLASSES, PooledPixels
from tests.paths import REPO

FAST = LinearConfig(protocol="fast", epochs=30, batch_size=16, crop_size=32, resize_size=36)


def test_top1_and_top5_on_a_hand_made_case():
    logits = torch.tensor([
        [9.0, 1, 2, 3, 4, 5],   # label 0: top-1
        [1.0, 9, 2, 3, 4, 5],   # label 5: second -> top-5 only
        [6.0, 5, 4, 3, 2, 1],   # label 5: last -> neither
        [0.0, 1, 2, 3, 4, 9],   # label 5: top-1
    ])
    labels = torch.tensor([0, 5, 5, 5])
    top1, top5, per_class = accuracy_report(logits, labels, 6)
    assert top1 == 0.5 and top5 == 0.75
    assert per_class == {0: 1.0, 5: pytest.approx(1 / 3)}
    assert accuracy_report(logits[:, :3], torch.tensor([0, 1, 2, 0]), 3)[1] is None  # < 5 classes: no top-5


def test_fast_linear_separates_the_classes_and_shuffled_labels_stay_at_chance(shape_shards, tmp_path, capsys):
    train, val = shape_shards
    result = evaluate_linear(PooledPixels(), train, val, FAST, output_dir=tmp_path)
    assert result.protocol == "linear-fast"
    assert result.top1 >= 0.9 and result.top5 == 1.0
    assert (result.num_train, result.num_val, result.skipped) == (72, 36, 1)
    assert "broken0" in capsys.readouterr().err  # the corrupt image is named, then skipped
    spec = FeatureSpec(crop_size=32, resize_size=36)
    train_set, val_set = (cached_features(PooledPixels(), resolve_shard_set(source), spec,
                                          cache_dir=tmp_path / "features") for source in (train, val))
    shuffled = FeatureSet(train_set.features, train_set.labels[torch.randperm(len(train_set),
                          generator=torch.Generator().manual_seed(3))])
    chance = train_linear_on_features(shuffled, val_set, FAST, num_classes=NUM_CLASSES)
    assert chance.top1 <= 0.4  # chance is 1/6; the real labels reach >= 0.9


# Runs in its own process: the growth of the peak RSS over training the fast head on a 200 MB bank.
HEAD_PEAK = """
import resource, torch
from relicv2.evaluation.features import FeatureSet
from relicv2.evaluation.linear import LinearConfig, train_linear_on_features
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
train = FeatureSet(torch.randn(100_000, 512, generator=g), torch.randint(0, 10, (100_000,), generator=g))
val = FeatureSet(torch.randn(1_000, 512, generator=g), torch.randint(0, 10, (1_000,), generator=g))
config = LinearConfig(protocol="fast", epochs=1, batch_size=4096)
train_linear_on_features(FeatureSet(train.features[:100], train.labels[:100]), val, config, num_classes=10)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
train_linear_on_features(train, val, config, num_classes=10)
print(train.features.numel() * 4, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_the_fast_head_standardises_a_batch_at_a_time_not_a_copy_of_the_bank():
    # A standardised copy of the bank held it three times at once (ImageNet's: 3 x 10 GiB).
    done = subprocess.run([sys.executable, "-c", HEAD_PEAK], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    bank, grown = map(int, done.stdout.split()[-2:])
    assert grown < 0.5 * bank, f"training the head grew the peak RSS by {grown / bank:.2f} x the bank"


def test_feature_cache_is_reused_and_keyed_by_the_encoder(shape_shards, tmp_path):
    train = resolve_shard_set(shape_shards[0])
    spec = FeatureSpec(crop_size=32, resize_size=36)
    first = cached_features(PooledPixels(), train, spec, cache_dir=tmp_path)
    path = cache_path(tmp_path, PooledPixels(), train, spec)
    assert path.is_file()
    torch.save({"format": "relicv2-feature-cache", "features": first.features * 0 + 7,
                "labels": first.labels, "skipped": 1}, path)
    assert torch.all(cached_features(PooledPixels(), train, spec, cache_dir=tmp_path).features == 7)  # from disk
    other = torch.nn.Conv2d(3, 3, 1)  # another encoder (different weights): another cache file
    assert cache_path(tmp_path, other, train, spec) != path
    assert cache_path(tmp_path, PooledPixels(), train, FeatureSpec(crop_size=24)) != path
    path.write_bytes(b"garbage")  # a corrupt cache is extracted again, not fatal
    assert torch.equal(cached_features(PooledPixels(), train, spec, cache_dir=tmp_path).features, first.features)


PAPER = LinearConfig(protocol="paper", epochs=8, batch_size=24, base_lr=2.0, crop_size=32, resize_size=36,
                            crop_scale=(0.6, 1.0), workers=0, backend="pil")


def test_paper_protocol_learns_and_resumes_to_the_same_head(shape_shards, tmp_path, monkeypatch):
    train, val = shape_shards
    whole = evaluate_linear(PooledPixels(), train, val, PAPER, output_dir=tmp_path / "whole")
    assert whole.protocol == "linear-paper" and whole.top1 >= 0.8
    assert (whole.num_train, whole.num_val) == (72, 36) and whole.skipped == 1
    real_loader = linear.epoch_batches
    calls = {"n": 0}

    def dying_loader(dataset, epoch, **options):
        calls["n"] += 1
        if dataset.train and calls["n"] == 3:  # killed at the start of the third epoch
            raise KeyboardInterrupt
        return real_loader(dataset, epoch, **options)

    monkeypatch.setattr(linear, "epoch_batches", dying_loader)
    with pytest.raises(KeyboardInterrupt):
        evaluate_linear(PooledPixels(), train, val, PAPER, output_dir=tmp_path / "resumed")
    saved = torch.load(tmp_path / "resumed" / linear.HEAD_FILE, weights_only=True)
    assert saved["epoch"] == 2
    monkeypatch.setattr(linear, "epoch_batches", real_loader)
    resumed = evaluate_linear(PooledPixels(), train, val, PAPER, output_dir=tmp_path / "resumed")
    assert resumed.top1 == whole.top1 and resumed.per_class_top1 == whole.per_class_top1
    final = torch.load(tmp_path / "resumed" / linear.HEAD_FILE, weights_only=True)
    reference = torch.load(tmp_path / "whole" / linear.HEAD_FILE, weights_only=True)
    assert torch.allclose(final["head"]["weight"], reference["head"]["weight"], atol=1e-6)
    with pytest.raises(HeadCheckpointError, match="other linear options"):
        evaluate_linear(PooledPixels(), train, val, dataclasses.replace(PAPER, base_lr=0.1),
                        output_dir=tmp_path / "resumed")
    other = PooledPixels()
    other.register_buffer("scale", torch.ones(1))  # other weights: another encoder
    with pytest.raises(HeadCheckpointError, match="written for another encoder; use another --output folder"):
        evaluate_linear(other, train, val, PAPER, output_dir=tmp_path / "resumed")


def test_paper_protocol_through_dali_views(shape_shards, tmp_path):
    train, val = shape_shards
    config = dataclasses.replace(PAPER, backend="dali", workers=1)
    result = evaluate_linear(PooledPixels(), train, val, config, output_dir=tmp_path)
    assert result.protocol == "linear-paper" and result.top1 >= 0.8
    assert (result.num_train, result.num_val, result.skipped) == (72, 36, 1)  # the corrupt JPEG left out


def _linear_rank(rank: int, world: int, port: int, train, val, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init("cpu")
    try:
        fast = evaluate_linear(PooledPixels(), train, val, FAST, ctx=ctx)
        paper_result = evaluate_linear(PooledPixels(), train, val, PAPER, ctx=ctx)
    finally:
        teardown(ctx)
    if rank == 0:
        out.write_text(json.dumps([fast.top1, fast.top5, fast.num_train, fast.num_val, fast.skipped,
                                   paper_result.top1, paper_result.num_val]))


def test_two_gloo_ranks_give_the_single_process_metrics(shape_shards, tmp_path, rank_pair):
    train, val = shape_shards
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks.json"
    rank_pair.run(_linear_rank, 2, port, train, val, out)
    fast = evaluate_linear(PooledPixels(), train, val, FAST)
    paper_result = evaluate_linear(PooledPixels(), train, val, PAPER)
    assert json.loads(out.read_text()) == [fast.top1, fast.top5, 72, 36, 1, paper_result.top1, 36]


def test_linear_cli_writes_the_json_contract(shape_shards, tmp_path):
    train, val = shape_shards
    out = tmp_path / "result.json"
    result = CliRunner().invoke(eval_group, [
        "linear", "--random-init", "18", "--train", str(train), "--val", str(val), "--preset", "fast",
        "--set", "epochs=5", "--set", "crop_size=32", "--set", "resize_size=32", "--json", str(out),
        "--output", str(tmp_path / "run"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "linear-fast" in result.output and "top-5" in result.output
    record = json.loads(out.read_text())
    assert record["protocol"] == "linear-fast" and record["random_init"] == 18 and record["checkpoint"] is None
    assert 0 <= record["top1"] <= 1 and record["top5"] is not None
    assert (record["num_train"], record["num_val"]) == (72, 36)
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == record
    assert record["head_file"] == str(tmp_path / "run" / "trained-head.pt") and (tmp_path / "run" / "trained-head.pt").is_file()
    bad = CliRunner().invoke(eval_group, ["linear", "--random-init", "18", "--train", str(train), "--val", str(val),
                                          "--set", "nonsense=1"])
    assert bad.exit_code != 0 and "unknown key nonsense; valid keys here are: " in bad.output


@pytest.mark.gpu
def test_on_a_gpu_the_fast_head_trains_there_and_scores_as_on_the_cpu(shape_shards, tmp_path):
    train, val = shape_shards
    on_cpu = evaluate_linear(PooledPixels(), train, val, FAST, output_dir=tmp_path)
    torch.cuda.reset_peak_memory_stats()
    on_gpu = evaluate_linear(PooledPixels(), train, val, FAST, device="cuda", output_dir=tmp_path)
    assert torch.cuda.max_memory_allocated() > 0  # the head and its batches were on the GPU
    assert on_gpu.top1 == pytest.approx(on_cpu.top1, abs=0.06) and on_gpu.num_train == on_cpu.num_train

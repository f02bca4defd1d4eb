"""Weighted cosine kNN: hand-checked votes, feature extraction from labelled shards, the eval CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import resource
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from PIL import Image
from torch import nn

from relicv2.cli.eval import eval_group
from relicv2.jobs.config import to_dict
from relicv2.models.heads import build_networks
from relicv2.pretrain.checkpoint import encoder_from_checkpoint, save_checkpoint
from relicv2.pretrain.config import KnnConfig, load_config
from relicv2.pretrain.distributed import init, teardown
from relicv2.pretrain.knn.classify import evaluate_knn, knn_predict
from relicv2.pretrain.knn.extract import extract_features, preprocess
from relicv2.pretrain.run import run_pretraining
from relicv2.shards import ShardSample, resolve_shard_set, write_shard_set
from tests.paths import REPO
from tests.threads import one_torch_thread


def test_votes_are_weighted_by_exp_similarity_over_temperature():
    # Query along x. Bank: one class-1 item almost on x (cos 0.99), two class-0 items at cos 0.8.
    bank = torch.tensor([[0.99, 0.141], [0.8, 0.6], [0.8, -0.6], [-1.0, 0.0]])
    labels = torch.tensor([1, 0, 0, 2])
    query = torch.tensor([[1.0, 0.0]])
    # k = 3, T = 0.07: class 1 weight exp(0.99/0.07) = 1.4e6 beats 2 * exp(0.8/0.07) = 1.8e5
    assert knn_predict(bank, labels, query, num_classes=3, k=3, temperature=0.07).tolist() == [1]
    # T = 1: exp(0.99) = 2.7 loses to 2 * exp(0.8) = 4.5, so the majority wins
    assert knn_predict(bank, labels, query, num_classes=3, k=3, temperature=1.0).tolist() == [0]
    # k = 1: nearest neighbour; features need not be normalised (cosine)
    assert knn_predict(bank * 5, labels, -query * 3, num_classes=3, k=1).tolist() == [2]


def test_queries_are_processed_in_chunks_with_the_same_answer():
    generator = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(50, 8, generator=generator), torch.randn(37, 8, generator=generator)
    labels = torch.randint(0, 5, (50,), generator=generator)
    whole = knn_predict(bank, labels, queries, num_classes=5, chunk_size=1000)
    assert torch.equal(whole, knn_predict(bank, labels, queries, num_classes=5, chunk_size=4))


# Runs in its own process: peak RSS is a high-water mark, so the figure is the call's alone.
KNN_PEAK = """
import resource, sys, torch
from relicv2.pretrain.knn.classify import knn_predict
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
bank, queries = torch.randn(150_000, 8, generator=g), torch.randn(1024, 8, generator=g)
labels = torch.randint(0, 10, (150_000,), generator=g)
knn_predict(bank[:10], labels[:10], queries[:2], num_classes=10)  # torch's own first-call allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
knn_predict(bank, labels, queries, num_classes=10)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_the_search_holds_a_bounded_block_of_similarities_not_one_per_1024_queries():
    # A 150,000-item bank: 1,024 queries at once would hold 614 MB of similarities (ImageNet's bank: 5.2 GB).
    done = subprocess.run([sys.executable, "-c", KNN_PEAK], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    # The bounded block is 256 MiB; the rest is the chunk's top-k and scatter.
    assert grown < 400 * 2**20, f"the search grew the peak RSS by {grown / 2**20:.0f} MiB"


# Runs in its own process on a set the test wrote: the growth of the peak RSS over extracting its bank.
BANK_PEAK = """
import resource, sys, torch
from relicv2.pretrain.knn.extract import extract_features
from relicv2.shards import resolve_shard_set
from tests.evaluation.test_knn import Wide
torch.set_num_threads(1)

bank = resolve_shard_set(sys.argv[1])
extract_features(Wide(), bank, crop_size=16, batch_size=32, part=(0, 100))  # first-call allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
features, _ = extract_features(Wide(), bank, crop_size=16, batch_size=32)
print(features.numel() * 4, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


class Wide(nn.Module):
    """32,768 features an image (its mean colour, repeated): 800 images make a 100 MiB bank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)).repeat(1, 32_768 // 3 + 1)[:, :32_768]


def _wide_bank(out):
    write_shard_set((ShardSample(f"s{i:04d}", {"jpg": _jpeg((i % 256, 90, 40), (20, 16))}, label=i % 3)
                     for i in range(800)), out)
    return out


def test_the_bank_is_held_once_while_its_features_are_extracted(tmp_path):
    # A list of batches concatenated at the end holds the bank twice (2 x 10 GiB at ImageNet's 1.28 M x 2048).
    _wide_bank(tmp_path / "bank")
    done = subprocess.run([sys.executable, "-c", BANK_PEAK, str(tmp_path / "bank")], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    bank, grown = map(int, done.stdout.split()[-2:])
    assert bank == 800 * 32_768 * 4
    assert grown < 1.4 * bank, f"extraction grew the peak RSS by {grown / bank:.2f} x the bank's {bank / 2**20:.0f} MiB"


def _jpeg(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


class MeanColour(nn.Module):
    """A stand-in encoder whose features are the mean colour: red and blue images separate exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


@pytest.fixture()
def colour_shards(tmp_path):
    """Labelled shard sets: class 0 reddish, class 1 bluish images of various sizes; one corrupt JPEG."""
    def samples(split: str, count: int, corrupt: bool):
        for i in range(count):
            shade = 40 + 20 * i
            label = i % 2
            colour = (220, shade % 120, 30) if label == 0 else (30, shade % 120, 220)
            yield ShardSample(f"{split}{i:03d}", {"jpg": _jpeg(colour, (48 + 8 * i, 40))}, label=label)
        if corrupt:
            yield ShardSample(f"{split}broken", {"jpg": b"\xff\xd8\xff not really a jpeg"}, label=0)

    write_shard_set(samples("train", 10, corrupt=True), tmp_path / "train")
    write_shard_set(samples("val", 6, corrupt=False), tmp_path / "val")
    return tmp_path / "train", tmp_path / "val"


def test_preprocess_resizes_the_short_side_and_centre_crops():
    image = preprocess(_jpeg((255, 0, 0), (80, 40)), crop_size=32, resize_size=36)
    assert image.shape == (3, 32, 32)
    # pure red, ImageNet-normalised
    assert image[0].mean().item() == pytest.approx((1.0 - 0.485) / 0.229, abs=0.05)
    assert image[2].mean().item() == pytest.approx((0.0 - 0.406) / 0.225, abs=0.05)


def test_knn_on_labelled_shards_skips_corrupt_images(colour_shards, capsys):
    train, val = colour_shards
    features, labels = extract_features(MeanColour(), resolve_shard_set(train), crop_size=32, batch_size=4)
    assert features.shape == (10, 3) and labels.tolist() == [i % 2 for i in range(10)]
    result = evaluate_knn(MeanColour(), train, val, settings=KnnConfig(k=3, crop_size=32, batch_size=4))
    assert result.top1 == 1.0 and (result.num_train, result.num_val) == (10, 6)
    assert result.skipped == 1  # the broken bank sample
    # single settings given as keywords replace those fields of the defaults
    assert evaluate_knn(MeanColour(), train, val, k=3, crop_size=32, batch_size=4) == result
    assert "skipping trainbroken" in capsys.readouterr().err


def test_a_bug_in_the_encoder_surfaces_instead_of_being_counted_as_a_bad_image(colour_shards):
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ZeroDivisionError("a bug, not a corrupt image")

    with pytest.raises(ZeroDivisionError):
        evaluate_knn(Broken(), *colour_shards, settings=KnnConfig(k=3, crop_size=32))


def test_feature_extraction_shows_progress_against_the_manifest_total(colour_shards, capsys):
    train, _ = colour_shards
    extract_features(MeanColour(), resolve_shard_set(train), crop_size=32, progress=True)
    err = capsys.readouterr().err
    assert "kNN features train" in err and "/11" in err  # 11 samples in the manifest (10 + the broken one)


def _join(rank: int, world_size: int, port: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    return init("cpu")


def _knn_rank(rank: int, world_size: int, port: int, jobs: list, out) -> None:
    """Every job (train, val, k) of a test in one pair of processes (spawning costs seconds each time)."""
    ctx = _join(rank, world_size, port)
    try:
        results = [evaluate_knn(MeanColour(), train, val, settings=KnnConfig(k=k, crop_size=32, batch_size=2),
                                ctx=ctx) for train, val, k in jobs]
    finally:
        teardown(ctx)
    if rank == 0:
        out.write_text(json.dumps([dataclasses.asdict(result) for result in results]))
    else:
        assert results == [None] * len(jobs)  # only rank 0 classifies


def _two_ranks(rank_main, jobs, tmp_path, pair=None):
    """What rank 0 of two gloo ranks running `rank_main(rank, 2, port, jobs, out)` writes to `out`: in the
    session's `pair` (`tests.rank_pair`), or without one in two processes spawned for this call alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two-ranks.json"
    if pair is not None:
        pair.run(rank_main, 2, port, jobs, out)
    else:
        mp.spawn(rank_main, args=(2, port, jobs, out), nprocs=2, join=True)
    return json.loads(out.read_text())


def _one_rank(train, val, k: int) -> dict:
    return dataclasses.asdict(evaluate_knn(MeanColour(), train, val, settings=KnnConfig(k=k, crop_size=32, batch_size=2)))


def _colour_set(out, name: str, colours: list, labels: list):
    write_shard_set((ShardSample(f"{name}{i:03d}", {"jpg": _jpeg(tuple(colour), (24, 24))}, label=label)
                     for i, (colour, label) in enumerate(zip(colours, labels, strict=True))), out / name)
    return out / name


def _random_colours(out, name: str, count: int, seed: int):
    """A labelled set whose nearest neighbours are not its classes: random colours, random labels of 3 classes."""
    generator = torch.Generator().manual_seed(seed)
    colours = torch.randint(0, 256, (count, 3), generator=generator).tolist()
    return _colour_set(out, name, colours, torch.randint(0, 3, (count,), generator=generator).tolist())


@pytest.mark.slow
def test_ranks_split_the_knn_images_and_rank_0_gets_the_single_process_result(colour_shards, tmp_path, rank_pair):
    train, val = colour_shards
    # Uneven parts (the bank's 11 samples, the broken one among them: 6 and 5) whose own nearest neighbours
    # differ from the union's: only a merge into the global k nearest gives the single process's top-1.
    noisy_train, noisy_val = _random_colours(tmp_path, "bank", 23, 0), _random_colours(tmp_path, "queries", 15, 1)
    # One sample each: rank 1's parts of the bank and of the queries are empty, and k exceeds the bank. The
    # query (cyan) is far from the bank's one item (red, cosine < 0): it is still its only neighbour, of its class
    # (class 0: sets that declare no classes number those they hold from 0).
    single_train = _colour_set(tmp_path, "one", [(255, 0, 0)], [0])
    single_val = _colour_set(tmp_path, "other", [(0, 255, 255)], [0])
    jobs = [(train, val, 3), (noisy_train, noisy_val, 5), (single_train, single_val, 3)]
    two = _two_ranks(_knn_rank, jobs, tmp_path, rank_pair)
    one = [_one_rank(*job) for job in jobs]
    assert two == one
    # every image counted once over the ranks (10 bank, 6 val), the corrupt one skipped once
    assert [(r["num_train"], r["num_val"], r["skipped"]) for r in one] == [(10, 6, 1), (23, 15, 0), (1, 1, 0)]
    assert 0 < one[1]["top1"] < 1 and one[2]["top1"] == 1  # figures a wrong merge changes
    bank = resolve_shard_set(train)
    halves = [extract_features(MeanColour(), bank, crop_size=32, part=(i, 2))[0] for i in range(2)]
    whole = extract_features(MeanColour(), bank, crop_size=32)[0]
    assert torch.equal(torch.cat(halves).sort(dim=0).values, whole.sort(dim=0).values)


def _peak_rank(rank: int, world_size: int, port: int, sets: tuple, out) -> None:
    bank, queries = sets
    ctx = _join(rank, world_size, port)
    settings = KnnConfig(k=5, crop_size=16, batch_size=32)
    try:
        evaluate_knn(Wide(), queries, queries, settings=settings, ctx=ctx)  # first-call allocations
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = evaluate_knn(Wide(), bank, queries, settings=settings, ctx=ctx)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    finally:
        teardown(ctx)
    if rank == 0:
        out.write_text(json.dumps([result.num_train, grown]))


@pytest.mark.slow
def test_under_two_ranks_rank_0_holds_its_part_of_the_bank_not_the_whole(tmp_path):
    # Gathering the ranks' parts to rank 0 held the whole bank there, and more (10 GB at ImageNet's 1.28 M x 2048).
    bank = _wide_bank(tmp_path / "bank")
    queries = _random_colours(tmp_path, "queries", 8, 0)
    # Processes of its own: the peak RSS is a high-water mark, so the figure is this job's alone.
    num_train, grown = _two_ranks(_peak_rank, (bank, queries), tmp_path)
    size = num_train * 32_768 * 4  # 100 MiB; rank 0's part is half of it
    assert num_train == 800
    assert grown < 0.75 * size, f"rank 0's peak RSS grew by {grown / size:.2f} x the bank's {size / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_on_a_gpu_the_bank_is_kept_and_searched_there_with_the_cpu_answer(colour_shards):
    train, val = colour_shards
    settings = KnnConfig(k=3, crop_size=32, batch_size=4)
    bank = resolve_shard_set(train)
    features, labels = extract_features(MeanColour(), bank, crop_size=32, device="cuda", keep_on="cuda")
    assert features.is_cuda and labels.is_cuda
    cpu = extract_features(MeanColour(), bank, crop_size=32)[0]
    assert torch.allclose(features.cpu(), cpu, atol=1e-2)  # bf16 autocast on the GPU
    predicted = knn_predict(features, labels, features, num_classes=2, k=1)
    assert predicted.is_cuda and torch.equal(predicted, labels)
    assert evaluate_knn(MeanColour(), train, val, settings=settings, device="cuda") == evaluate_knn(
        MeanColour(), train, val, settings=settings)


def test_unlabelled_shards_are_refused(tmp_path):
    write_shard_set([ShardSample("a", {"jpg": _jpeg((1, 2, 3), (16, 16))})], tmp_path / "unlabelled")
    with pytest.raises(ValueError, match="has no class label"):
        extract_features(MeanColour(), resolve_shard_set(tmp_path / "unlabelled"), crop_size=16)
    import webdataset as wds

    (tmp_path / "named").mkdir()
    with wds.ShardWriter(str(tmp_path / "named" / "train-%04d.tar"), verbose=0) as sink:
        sink.write({"__key__": "b", "jpg": _jpeg((1, 2, 3), (16, 16)), "cls": b"tench"})
    with pytest.raises(ValueError, match="sample b in .* has cls 'tench', not a class index"):
        extract_features(MeanColour(), resolve_shard_set(tmp_path / "named"), crop_size=16)


def _tiny_checkpoint(out) -> None:
    config = load_config(None, ["model.depth=18", "model.hidden_dim=16", "model.out_dim=8"])
    online, target = build_networks(18, 1, hidden_dim=16, out_dim=8)
    with torch.no_grad():
        online.encoder.conv1.weight.fill_(0.01)  # recognisable weights
    save_checkpoint(out, {"config": to_dict(config), "step": 1, "online": online.state_dict(),
                          "target": target.state_dict(), "optimizer": {}, "rng": [], "data": []}, keep=1)


def test_encoder_from_checkpoint_and_eval_cli(colour_shards, tmp_path):
    _tiny_checkpoint(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-000000001.pt"
    encoder = encoder_from_checkpoint(checkpoint)
    assert torch.all(encoder.conv1.weight == 0.01)
    train, val = colour_shards
    result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(checkpoint), "--train", str(train),
                                             "--val", str(val), "--crop-size", "32", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    assert "kNN top-1" in result.output and "10 train" in result.output
    from_folder = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(tmp_path / "run"), "--train", str(train),
                                                  "--val", str(val), "--crop-size", "32", "--network", "target"])
    assert from_folder.exit_code == 0 and "checkpoint-000000001.pt (target)" in from_folder.output
    empty = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(tmp_path), "--train", str(train),
                                            "--val", str(val)])
    assert empty.exit_code != 0 and "no checkpoint-*.pt in" in empty.output
    missing = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(tmp_path / "nope.pt"),
                                              "--train", str(train), "--val", str(val)])
    assert missing.exit_code != 0 and "does not exist" in missing.output and "--resume" not in missing.output


def test_eval_knn_json_and_random_init(colour_shards, tmp_path):
    train, val = colour_shards
    out = tmp_path / "knn.json"
    result = CliRunner().invoke(eval_group, ["knn", "--random-init", "18", "--train", str(train), "--val", str(val),
                                             "--crop-size", "32", "--k", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    expected = evaluate_knn(random_encoder_for_test(), train, val, settings=KnnConfig(k=3, crop_size=32))
    assert record["protocol"] == "knn" and record["random_init"] == 18 and record["checkpoint"] is None
    assert (record["num_train"], record["num_val"], record["skipped"]) == (10, 6, 1)
    assert record["top1"] == pytest.approx(expected.top1)


def random_encoder_for_test():
    from relicv2.pretrain.checkpoint import random_encoder

    return random_encoder(18, seed=0)


@pytest.mark.parametrize("option, value, message", [
    ("--temperature", "0", "temperature must be positive"),
    ("--temperature", "nan", "temperature must be a finite number"),
    ("--k", "0", "0 is not in the range"),
])
def test_eval_knn_refuses_bad_settings_before_working(colour_shards, option, value, message):
    train, val = colour_shards
    result = CliRunner().invoke(eval_group, ["knn", "--random-init", "18", "--train", str(train), "--val", str(val),
                                             option, value])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def _tamper(path, **fields):
    payload = torch.load(path, weights_only=True)
    payload.update(fields)
    torch.save(payload, path)


@pytest.mark.parametrize("fields, message", [
    ({"step": "seven"}, "field 'step' is a str"),
    ({"online": [1, 2]}, "field 'online' is a list"),
    ({"config": {"model": {"depth": "fifty"}}}, "model.depth must be of type int"),
    ({"config": {"model": {"width": 2}}}, "do not fit the ResNet-50 (width 2)"),
])
def test_hand_made_checkpoints_give_one_line_errors_in_eval_knn(colour_shards, tmp_path, fields, message):
    _tiny_checkpoint(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-000000001.pt"
    _tamper(checkpoint, **fields)
    train, val = colour_shards
    result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(checkpoint), "--train", str(train),
                                             "--val", str(val)])
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_knn_monitor_runs_at_epoch_ends_during_pretraining(colour_shards, tmp_path):
    train, val = colour_shards
    config = load_config(None, [
        "data.source=synthetic", "data.synthetic_images=16", "model.depth=18", "model.hidden_dim=16",
        "model.out_dim=8", "views.large_views=2", "views.small_views=0", "views.large_size=16",
        "optim.global_batch=8", "optim.epochs=2", "optim.warmup_epochs=0", "loss.num_negatives=7",
        f"run.output_dir={tmp_path / 'run'}", "run.device=cpu", "run.progress_bar=false", "run.log_every=1",
        f"knn.train_shards={train}", f"knn.val_shards={val}", "knn.every_epochs=1", "knn.crop_size=16",
        "knn.k=3",
    ])
    with one_torch_thread(), contextlib.redirect_stdout(io.StringIO()):
        run_pretraining(config, auto_resume=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    knn = [r for r in records if "knn_top1" in r]
    assert [r["step"] for r in knn] == [2, 4]  # 2 steps per epoch, every epoch
    assert [r["knn_skipped"] for r in knn] == [1.0, 1.0]  # the broken bank image, counted
    # the monitor scores the encoder being trained: at the last step it is the saved one
    final = encoder_from_checkpoint(tmp_path / "run")
    expected = evaluate_knn(final, train, val, settings=config.knn)
    assert knn[-1]["knn_top1"] == pytest.approx(expected.top1)


def test_the_knn_monitor_scores_a_damaged_set_without_stopping_the_run_and_says_so(colour_shards, tmp_path):
    train, val = colour_shards
    (tar,) = sorted(val.glob("*.tar"))
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 3])  # the last samples are cut off
    config = load_config(None, [
        "data.source=synthetic", "data.synthetic_images=8", "model.depth=18", "model.hidden_dim=16",
        "model.out_dim=8", "views.large_views=2", "views.small_views=0", "views.large_size=16",
        "optim.global_batch=8", "optim.epochs=1", "optim.warmup_epochs=0", "loss.num_negatives=7",
        f"run.output_dir={tmp_path / 'run'}", "run.device=cpu", "run.progress_bar=false", "run.log_every=1",
        f"knn.train_shards={train}", f"knn.val_shards={val}", "knn.every_epochs=1", "knn.crop_size=16", "knn.k=3",
    ])
    printed = io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        assert run_pretraining(config, auto_resume=False).step == 1
    (knn,) = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "knn_top1" in r]
    assert knn["knn_lost"] > 0
    assert f"the kNN monitor's set {val} lost samples" in printed.getvalue() and "shards verify" in printed.getvalue()

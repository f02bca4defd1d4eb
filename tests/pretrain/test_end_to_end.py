"""The whole CPU chain from the command line: demo images -> shards (2 ranks + `shards merge`) ->
`relicv2 pretrain` on the shards with the reference and the DALI backend -> kill -> resume with
equal losses -> `--fresh` -> `eval knn --random-init`."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.pretrain.checkpoint import list_checkpoints
from relicv2.pretrain.views.loader import dali_available

TINY = ["model.depth=18", "model.hidden_dim=32", "model.out_dim=16", "views.large_views=2", "views.small_views=1",
        "views.large_size=32", "views.small_size=16", "views.mask_probability=0.0", "optim.global_batch=8",
        "optim.epochs=2", "optim.warmup_epochs=0.5", "loss.num_negatives=7", "run.device=cpu",
        "run.progress_bar=false", "run.log_every=1", "run.checkpoint_every=2", "knn.train_shards=",
        "knn.val_shards="]


def invoke(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result


@pytest.fixture(autouse=True)
def free_pipelines_after(one_thread):
    yield
    # Free the runs' DALI pipelines (and their worker threads) now: later tests in this process fork
    # DataLoader workers, and forking while foreign threads hold locks can hang the children.
    gc.collect()


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("e2e")
    made = invoke("demo-data", str(root / "images"), "--train-per-class", "4", "--val-per-class", "2",
                  "--size", "48")
    assert made.exit_code == 0, made.output
    # train: a 2-rank build (as under torchrun), rank 0 giving up on waiting, then `shards merge`
    for rank in (0, 1):
        built = invoke("shards", "build", str(root / "images" / "train"), str(root / "train"), "--max-count", "8",
                       "--workers", "1", "--no-progress", "--merge-timeout", "0",
                       env={"RANK": str(rank), "WORLD_SIZE": "2"})
        assert built.exit_code in (0, 1), built.output
    merged = invoke("shards", "merge", str(root / "train"))
    assert merged.exit_code == 0, merged.output
    assert (root / "train" / "manifest.parquet").is_file()
    built = invoke("shards", "build", str(root / "images" / "val"), str(root / "val"), "--workers", "1",
                   "--no-progress")
    assert built.exit_code == 0, built.output
    return root / "train", root / "val"


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def pretrain(out: Path, shards: Path, backend: str, *extra: str, fresh: bool = False):
    options = [arg for option in (*TINY, f"data.train_shards={shards}", f"views.backend={backend}", *extra)
               for arg in ("--set", option)]
    return invoke("pretrain", "--config", "demo-cpu", "--output", str(out), *options,
                  *(["--fresh"] if fresh else []))


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("dali", marks=pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed")),
])
def test_pretrain_on_shards_killed_and_resumed_equals_an_uninterrupted_run(shard_sets, tmp_path, backend):
    train, _ = shard_sets
    # 26 training images (24 crops + 2 awkward files that convert), 3 steps per epoch of 8. The run
    # logs steps 1-4 and saves checkpoints 2 and 4; then it "dies" before checkpoint 4 reached the
    # disk: the rerun resumes from step 2, crosses the epoch boundary again and must log exactly
    # what the first attempt logged. With DALI both attempts make their batches ahead in a thread
    # (as on a GPU), so checkpoint 2 is taken while later batches are already made.
    ahead = ["views.ready_batches=2"] if backend == "dali" else []
    first = pretrain(tmp_path / "run", train, backend, "run.max_steps=4", *ahead)
    assert first.exit_code == 0, first.output
    expected = losses(tmp_path / "run")
    assert sorted(expected) == [1, 2, 3, 4]
    (tmp_path / "run" / "checkpoint-000000004.pt").unlink()
    resumed = pretrain(tmp_path / "run", train, backend, "run.max_steps=4", *ahead)
    assert resumed.exit_code == 0 and "resumed from" in resumed.output and "at step 2" in resumed.output, \
        resumed.output
    assert losses(tmp_path / "run") == expected  # bit for bit on CPU, one record per step
    if backend == "dali":
        return  # --fresh and old states do not depend on the backend: checked once, on the cheaper one
    # a checkpoint whose saved config holds the removed colour stage keys: with the values that remain the
    # run resumes exactly and quietly; with the all-DALI stage, whose stream is gone, at its global position
    checkpoint = tmp_path / "run" / "checkpoint-000000002.pt"
    written = checkpoint.read_bytes()
    for stage, hue in (("torch", "hsv"), ("dali", "yiq")):
        (tmp_path / "run" / "checkpoint-000000004.pt").unlink()
        payload = torch.load(checkpoint, weights_only=False)
        payload["config"]["views"].update(colour_stage=stage, hue_model=hue)
        torch.save(payload, checkpoint)
        old = pretrain(tmp_path / "run", train, backend, "run.max_steps=4")
        assert old.exit_code == 0 and "resumed from" in old.output and "at step 2" in old.output, old.output
        removed = "was trained with views.colour_stage='dali', views.hue_model='yiq', removed since"
        assert (removed in old.output) == (stage == "dali") and "config differs" not in old.output, old.output
        assert ("continues at the same data position (epoch 0, 16 samples in)" in old.output) == (stage == "dali")
        assert losses(tmp_path / "run") == expected
    checkpoint.write_bytes(written)
    # a checkpoint whose loader state an earlier relicv2 wrote: the run continues at its global
    # position (the reference stream does not depend on how it was reached, so exactly here)
    (tmp_path / "run" / "checkpoint-000000004.pt").unlink()
    payload = torch.load(tmp_path / "run" / "checkpoint-000000002.pt", weights_only=False)
    payload["data"][0]["version"] = 2
    torch.save(payload, tmp_path / "run" / "checkpoint-000000002.pt")
    upgraded = pretrain(tmp_path / "run", train, backend, "run.max_steps=4")
    assert upgraded.exit_code == 0 and "from another relicv2 version" in upgraded.output, upgraded.output
    assert "continues at the same data position (epoch 0, 16 samples in)" in upgraded.output
    assert losses(tmp_path / "run") == expected
    fresh = pretrain(tmp_path / "run", train, backend, "run.max_steps=1", fresh=True)
    assert fresh.exit_code == 0 and "moved the earlier run's" in fresh.output, fresh.output
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-000000001.pt"]
    assert losses(tmp_path / "run") == {1: expected[1]}  # the same run, from scratch


def test_eval_knn_random_init_on_the_shard_sets(shard_sets, tmp_path):
    train, val = shard_sets
    out = tmp_path / "knn.json"
    result = invoke("eval", "knn", "--random-init", "18", "--train", str(train), "--val", str(val),
                    "--crop-size", "32", "--json", str(out))
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    # the demo's val set: 2 crops of each photo class; every image decodes
    assert record["num_val"] > 0 and record["num_train"] > record["num_val"]
    assert 0 < record["top1"] and f"{record['top1']:.4f}" in result.output

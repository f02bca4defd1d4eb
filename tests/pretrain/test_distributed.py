"""Distributed set-up, and the key property: W ranks x batch B == one process with batch W*B.

BatchNorm: each rank normalising with its own B images is not the same as one process normalising
with W*B, so the equality only holds with BN statistics over the global batch. Multi-rank runs
turn that on by default (`model.sync_batchnorm: null`); on CPU it is `CrossRankBatchNorm`.
The negatives are drawn for the whole global batch from a generator seeded by (seed, step) on
every rank, so even subsampled negatives are the same draws as in the single process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relicv2.pretrain.checkpoint import load_checkpoint
from relicv2.pretrain.config import load_config
from relicv2.pretrain.distributed import describe_environment
from relicv2.pretrain.run import run_pretraining
from relicv2.shards import ShardSample, index_path, write_shard_set
from relicv2.shards.checks import check_path, check_shard_set
from relicv2.shards.shardset import cached_index_path, derive_missing_indexes
from tests.once import built_once
from tests.threads import one_torch_thread


def config_overrides(out: Path, global_batch: int, num_negatives: int, shards: Path | None = None) -> list[str]:
    data = (["data.source=synthetic", "data.synthetic_images=32"] if shards is None else
            ["data.source=shards", f"data.train_shards={shards}", "views.mask_probability=0.0",
             "views.backend=reference", "views.num_threads=1",
             "views.ready_batches=1"])  # batches made ahead in a thread, as on a GPU: checkpoints stay exact
    return [
        *data, "model.depth=18", "model.hidden_dim=32",
        "model.out_dim=16", "views.large_views=2", "views.small_views=1", "views.large_size=16",
        "views.small_size=8", f"optim.global_batch={global_batch}", "optim.epochs=1",
        "optim.warmup_epochs=0.5", "optim.base_lr=0.3", f"loss.num_negatives={num_negatives}",
        f"run.output_dir={out}", "run.device=cpu", "run.log_every=1", "run.progress_bar=false",
    ]


def _rank_main(rank: int, world_size: int, ports: list[int], jobs: list[tuple[list[str], str | None]],
               index_cache: Path) -> None:
    """Every 2-rank run of this module, one after the other in the session's pair (`tests.rank_pair`)."""
    torch.set_num_threads(1)
    os.environ["RELICV2_INDEX_CACHE"] = str(index_cache)
    for port, (overrides, resume) in zip(ports, jobs, strict=True):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with contextlib.redirect_stdout(io.StringIO()):
            run_pretraining(load_config(None, overrides), resume=resume, auto_resume=False)


def _single(overrides: list[str], resume: Path | None = None) -> None:
    with one_torch_thread(), contextlib.redirect_stdout(io.StringIO()):
        run_pretraining(load_config(None, overrides), resume=resume, auto_resume=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


NEGATIVES = {"all-negatives": 7, "subsampled-negatives": 3}
CUT = "run.max_steps=2"  # the "killed" runs stop after their step-2 checkpoint


def _shard_set(out: Path) -> Path:
    """32 small random JPEGs in 4 shards."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(32):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (28, 36, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        samples.append(ShardSample(f"s{i:03d}", {"jpg": buffer.getvalue()}, i % 4, {}))
    write_shard_set(samples, out, max_count=8)
    return out


def _plain_copy(shards: Path, out: Path) -> Path:
    """The same tars without manifest or index files, as other WebDataset tools write them."""
    out.mkdir()
    for tar in sorted(shards.glob("*.tar")):
        shutil.copy(tar, out / tar.name)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rank_pair) -> Path:
    """4-step runs: 1 process and 2 ranks uninterrupted (both negative settings), and the resumes
    2 ranks -> 1 process and 1 process -> 2 ranks after step 2 (subsampled negatives), on
    generated data and on a shard set (reference view backend); the run killed on 2 ranks (and its
    resume) reads a plain copy of the set, whose index files the ranks derive between them. Made once
    per session whichever workers run the tests (`tests.once`)."""
    return built_once(tmp_path_factory, "distributed-runs", lambda root: _make_runs(root, rank_pair))


def _make_runs(root: Path, rank_pair) -> None:
    shards = _shard_set(root / "shards")
    plain = _plain_copy(shards, root / "plain")
    for name, negatives in NEGATIVES.items():
        _single(config_overrides(root / f"one-{name}", 8, negatives))
    _single([*config_overrides(root / "one-killed", 8, 3), CUT])
    _single(config_overrides(root / "one-shards", 8, 3, shards))
    _single([*config_overrides(root / "one-shards-killed", 8, 3, shards), CUT])
    jobs = [(config_overrides(root / f"two-{name}", 8, negatives), None) for name, negatives in NEGATIVES.items()]
    jobs += [([*config_overrides(root / "two-killed", 8, 3), CUT], None),
             (config_overrides(root / "one-to-two", 8, 3), str(root / "one-killed" / "checkpoint-000000002.pt")),
             ([*config_overrides(root / "two-shards-killed", 8, 3, plain), CUT], None),
             (config_overrides(root / "one-to-two-shards", 8, 3, shards),
              str(root / "one-shards-killed" / "checkpoint-000000002.pt"))]
    ports = [_free_port() for _ in jobs]
    rank_pair.run(_rank_main, 2, ports, jobs, root / "index-cache")
    _single(config_overrides(root / "two-to-one", 8, 3), resume=root / "two-killed" / "checkpoint-000000002.pt")
    _single(config_overrides(root / "two-to-one-shards", 8, 3, plain),
            resume=root / "two-shards-killed" / "checkpoint-000000002.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEGATIVES))
def test_two_gloo_ranks_match_one_process_with_the_global_batch(runs, name):
    two, one = runs / f"two-{name}", runs / f"one-{name}"
    losses_two, losses_one = _losses(two), _losses(one)
    assert len(losses_two) == len(losses_one) == 4
    # Observed differences are ~1e-6 (summation order). Per-rank BN statistics instead of global
    # ones (model.sync_batchnorm=false) move these losses by 0.1-0.6, far outside the tolerance.
    assert losses_two == pytest.approx(losses_one, rel=1e-4)
    a = load_checkpoint(two / "checkpoint-000000004.pt")
    b = load_checkpoint(one / "checkpoint-000000004.pt")
    assert len(a["data"]) == 2 and len(b["data"]) == 1  # one data-pipeline state per rank
    assert a["data_position"] == b["data_position"] == {"epoch": 1, "samples": 0}  # the global position
    for network in ("online", "target"):
        for key, value in b[network].items():
            if value.is_floating_point():
                torch.testing.assert_close(a[network][key], value, rtol=1e-4, atol=1e-5, msg=f"{network}.{key}")
            else:
                assert torch.equal(a[network][key], value), key


@pytest.mark.parametrize(("resumed", "uninterrupted"), [
    ("two-to-one", "one-subsampled-negatives"), ("one-to-two", "one-subsampled-negatives"),
    ("two-to-one-shards", "one-shards"), ("one-to-two-shards", "one-shards"),
])
def test_resume_with_another_number_of_ranks_continues_the_uninterrupted_run(runs, resumed, uninterrupted):
    # The data position is global (samples consumed in the epoch's order), so steps 3 and 4 see
    # the same global batches whatever the number of ranks that resumed.
    expected = _losses(runs / uninterrupted)[2:]
    got = _losses(runs / resumed)
    assert len(got) == 2
    assert got == pytest.approx(expected, rel=1e-4)
    # a different data position (starting the epoch over) gives losses far outside that tolerance
    assert got != pytest.approx(_losses(runs / uninterrupted)[:2], rel=1e-2)


def test_two_ranks_on_shards_match_one_process_before_the_kill(runs):
    assert _losses(runs / "two-shards-killed") == pytest.approx(_losses(runs / "one-shards")[:2], rel=1e-4)
    # the plain copy's 4 index files were derived once, between the ranks, and match the originals
    derived = sorted((runs / "index-cache").glob("*.idx"))
    assert len(derived) == 4
    originals = {tar.stem: index_path(tar).read_text() for tar in (runs / "shards").glob("*.tar")}
    assert all(idx.read_text() == originals[idx.stem.rsplit("-", 1)[0]] for idx in derived)
    cache = runs / "index-cache"  # and the plain tars' samples checked, their verdicts kept for every later start
    assert all(check_path(tar, cached_index_path(tar, cache), True, cache).is_file() for tar in (runs / "plain").glob("*.tar"))


def test_missing_indexes_are_derived_in_disjoint_parts_that_cover_the_set(tmp_path):
    plain = _plain_copy(_shard_set(tmp_path / "shards"), tmp_path / "plain")
    cache = tmp_path / "cache"
    parts = [derive_missing_indexes(plain, index_cache=cache, part=(rank, 3)) for rank in range(3)]
    assert [(d.written, d.tars, d.failed) for d in parts] == [(2, 4, {}), (1, 4, {}), (1, 4, {})]
    assert derive_missing_indexes(plain, index_cache=cache).written == 0  # nothing left: opening the set reads no tar
    assert len(list(cache.glob("*.idx"))) == 4
    checks = [check_shard_set(plain, index_cache=cache, part=(rank, 3)) for rank in range(3)]
    assert [(c.fresh, c.unstored, sum(c.left_out.values())) for c in checks] == [(2, 0, 0), (1, 0, 0), (1, 0, 0)]
    assert check_shard_set(plain, index_cache=cache).fresh == 0  # every tar's samples were read once


def test_environment_description_reads_torchrun_variables():
    ctx = describe_environment("cpu", env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend) == (3, 4, 1, "gloo")
    assert ctx.device == torch.device("cpu") and ctx.is_distributed and not ctx.is_main
    single = describe_environment("cpu", env={})
    assert (single.rank, single.world_size, single.is_main, single.is_distributed) == (0, 1, True, False)
    with pytest.raises(RuntimeError, match="outside WORLD_SIZE"):
        describe_environment("cpu", env={"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="malformed torchrun environment"):
        describe_environment("cpu", env={"RANK": "zero"})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            describe_environment("cuda", env={})

"""ViewLoader: epochs, ranks, resume, labels, and the bad-data policy (both backends)."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from relicv2.pretrain.views.config import CPU_THREADS, GPU_THREADS_MAX, ViewConfig, loader_threads
from relicv2.pretrain.views.loader import ViewLoader
from relicv2.pretrain.views.source import global_position_state
from relicv2.shards import ShardSample, write_shard_set

TINY = dict(large_views=2, small_views=1, large_size=24, small_size=16, num_threads=1)
BACKENDS = ["dali", "reference"]


def jpeg(seed: int, size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size + 8, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def plain_set(directory, count: int, labelled: bool = True):
    samples = [ShardSample(f"k{i:03d}", {"jpg": jpeg(i)}, i % 7 if labelled else None, {}) for i in range(count)]
    write_shard_set(samples, directory, prefix="images", max_count=9)
    return directory


@pytest.fixture(scope="module")
def forty(tmp_path_factory):
    return plain_set(tmp_path_factory.mktemp("forty"), 40)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_see_disjoint_samples_covering_the_epoch(forty, backend):
    seen, seen_next = [], []
    for rank in range(2):
        loader = ViewLoader(forty, 4, ViewConfig(**TINY), rank=rank, world_size=2, seed=3, backend=backend)
        assert len(loader) == 5 and loader.epoch_size == 20
        batches = list(loader)  # the iteration ends by itself after one epoch
        assert len(batches) == 5
        keys = [k for b in batches for k in b["keys"]]
        assert len(set(keys)) == 20
        seen.append(set(keys))
        seen_next.append({k for b in loader for k in b["keys"]})  # epoch 2: a new shared order
        labels = torch.cat([b["labels"] for b in batches])
        assert labels.dtype == torch.int64
        assert labels.tolist() == [int(k[1:]) % 7 for k in keys]  # labels travel with their keys
        for b in batches:
            assert [v.shape for v in b["views"]] == [(4, 3, 24, 24)] * 2 + [(4, 3, 16, 16)]
    everything = {f"k{i:03d}" for i in range(40)}
    for epoch in (seen, seen_next):
        assert not epoch[0] & epoch[1]
        assert epoch[0] | epoch[1] == everything


@pytest.mark.parametrize("backend", BACKENDS)
def test_epochs_end_reshuffle_and_drop_the_incomplete_batch(tmp_path, backend):
    plain_set(tmp_path, 22, labelled=False)
    loader = ViewLoader(tmp_path, 4, ViewConfig(**TINY), seed=1, backend=backend)
    assert len(loader) == 5  # 22 samples: 5 full batches, 2 left over are dropped
    first = [k for b in loader for k in b["keys"]]
    second_batches = list(loader)
    second = [k for b in second_batches for k in b["keys"]]
    assert len(first) == len(second) == 20 and len(set(first)) == 20
    assert first != second  # a new order each epoch
    assert loader.epoch == 2
    assert second_batches[0]["labels"] is None  # unlabelled shards give no labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_gives_exactly_the_next_batch(forty, backend):
    loader = ViewLoader(forty, 4, ViewConfig(**TINY), seed=9, backend=backend)
    batches = iter(loader)
    for _ in range(2):
        next(batches)
    state = loader.state_dict()
    expected = [next(batches) for _ in range(4)]  # crosses into the next epoch's reader state too
    resumed = ViewLoader(forty, 4, ViewConfig(**TINY), seed=9, backend=backend)
    resumed.load_state_dict(state)
    got = list(resumed)
    assert len(got) == 8  # the rest of the epoch
    for want, have in zip(expected, got[:4], strict=True):
        assert want["keys"] == have["keys"]
        for a, b in zip(want["views"], have["views"], strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="seed"):
        ViewLoader(forty, 4, ViewConfig(**TINY), seed=10, backend=backend).load_state_dict(state)


def _epoch_of_global_batches(shards, world_size: int, global_batch: int) -> list[tuple[list[str], list]]:
    """One epoch as global batches: the ranks' batches put together in rank order (keys, views)."""
    per_rank = [list(ViewLoader(shards, global_batch // world_size, ViewConfig(**TINY), rank=r, world_size=world_size,
                                seed=5, backend="reference")) for r in range(world_size)]
    return [([k for b in parts for k in b["keys"]], [torch.cat([b["views"][v] for b in parts]) for v in range(3)])
            for parts in zip(*per_rank, strict=True)]


def test_reference_global_batches_do_not_depend_on_the_number_of_ranks(forty):
    # What lets a run resume on another number of ranks and continue the same stream.
    one, two = _epoch_of_global_batches(forty, 1, 8), _epoch_of_global_batches(forty, 2, 8)
    assert len(one) == len(two) == 5
    for (keys_one, views_one), (keys_two, views_two) in zip(one, two, strict=True):
        assert keys_one == keys_two
        for a, b in zip(views_one, views_two, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_global_position_continues_on_another_number_of_ranks(forty, backend, before, after):
    # 2 global batches of 8 consumed by `before` ranks; `after` ranks continue from the global position.
    state = global_position_state(epoch=0, samples=16, global_batch=8)
    rest = [ViewLoader(forty, 8 // after, ViewConfig(**TINY), rank=r, world_size=after, seed=5, backend=backend)
            for r in range(after)]
    for loader in rest:
        loader.load_state_dict(state)
    batches = [list(loader) for loader in rest]
    assert [len(b) for b in batches] == [3] * after  # the epoch's remaining 3 of 5 global batches
    keys = [k for parts in zip(*batches, strict=True) for b in parts for k in b["keys"]]
    if backend == "reference":  # exactly the uninterrupted run's last 3 global batches
        assert keys == [k for batch_keys, _ in _epoch_of_global_batches(forty, before, 8)[2:] for k in batch_keys]
    else:  # DALI: 24 distinct images from a new reader order over the new shares
        assert len(set(keys)) == 24
    following = {k for loader in rest for b in loader for k in b["keys"]}
    assert len(following) == 40  # the next epoch is whole again
    assert all(loader.epoch == 2 for loader in rest)
    with pytest.raises(ValueError, match="global batches of 8"):
        ViewLoader(forty, 2, ViewConfig(**TINY), seed=5, backend=backend).load_state_dict(state)
    with pytest.raises(ValueError, match="not a batch boundary"):
        rest[0].load_state_dict(global_position_state(epoch=0, samples=12, global_batch=8))


def test_a_dali_run_resplit_by_a_global_position_resumes_exactly_later(forty):
    # After a re-split the reader's epoch runs behind the loader's batch count; a later resume with
    # the same ranks must keep that offset, or loader and reader epochs drift apart.
    loader = ViewLoader(forty, 8, ViewConfig(**TINY), seed=5, backend="dali")
    loader.load_state_dict(global_position_state(epoch=0, samples=16, global_batch=8))
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    expected = [b["keys"] for b in batches] + [b["keys"] for b in loader]  # rest of epoch 0, then epoch 1
    resumed = ViewLoader(forty, 8, ViewConfig(**TINY), seed=5, backend="dali")
    resumed.load_state_dict(state)
    got = [b["keys"] for b in resumed] + [b["keys"] for b in resumed]
    assert got == expected and len(got) == 2 + 5
    assert len({k for keys in got[2:] for k in keys}) == 40  # epoch 1 is whole


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_across_an_epoch_boundary(tmp_path, backend):
    plain_set(tmp_path, 10)
    loader = ViewLoader(tmp_path, 4, ViewConfig(**TINY), seed=2, backend=backend)
    list(loader)  # epoch 0 (2 batches, 2 samples dropped)
    state = loader.state_dict()
    expected = list(loader)
    resumed = ViewLoader(tmp_path, 4, ViewConfig(**TINY), seed=2, backend=backend)
    resumed.load_state_dict(state)
    got = list(resumed)
    assert [b["keys"] for b in got] == [b["keys"] for b in expected]
    assert all(torch.equal(a["views"][0], b["views"][0]) for a, b in zip(expected, got, strict=True))


@pytest.fixture(scope="module")
def bad_set(tmp_path_factory):
    """24 good masked samples plus: a truncated JPEG, a non-JPEG, an empty JPEG, a corrupt mask,
    a JPEG corrupted in the middle (only a decode finds it) and a sample without a mask member."""
    mask = np.zeros((40, 48), np.uint8)
    mask[10:30, 10:30] = 255
    good = [ShardSample(f"g{i:02d}", {"jpg": jpeg(i), "mask.png": png(mask)}, 1, {}) for i in range(24)]
    body = jpeg(100)
    bad = [
        ShardSample("truncated", {"jpg": body[: len(body) // 2], "mask.png": png(mask)}, 1, {}),
        ShardSample("notjpeg", {"jpg": b"GIF89a" + bytes(200), "mask.png": png(mask)}, 1, {}),
        ShardSample("empty", {"jpg": b"", "mask.png": png(mask)}, 1, {}),
        ShardSample("badmask", {"jpg": jpeg(101), "mask.png": b"not a png at all"}, 1, {}),
        ShardSample("midcorrupt", {"jpg": body[:2] + bytes(40) + body[42:], "mask.png": png(mask)}, 1, {}),
        ShardSample("nomask", {"jpg": jpeg(102)}, 1, {}),
    ]
    out = tmp_path_factory.mktemp("bad")
    write_shard_set(good[:10] + bad[:3] + good[10:] + bad[3:], out, prefix="masked", max_count=8)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_samples_are_skipped_counted_and_never_crash(bad_set, backend):
    with pytest.warns(UserWarning, match="left out 5 bad samples"):
        loader = ViewLoader(bad_set, 5, ViewConfig(mask_probability=1.0, **TINY), seed=0, backend=backend,
                            verify="decode")
    assert loader.skipped == {"truncated_image": 1, "not_an_image": 1, "empty_image": 1, "bad_mask": 1,
                              "undecodable_image": 1}
    assert loader.samples.without_mask == 1
    keys = [k for b in loader for k in b["keys"]]
    assert len(keys) == 25 and set(keys) == {f"g{i:02d}" for i in range(24)} | {"nomask"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_corruption_found_only_by_decoding_is_skipped_during_the_run(bad_set, backend):
    with pytest.warns(UserWarning, match="left out 4 bad samples"):
        loader = ViewLoader(bad_set, 5, ViewConfig(**TINY), seed=0, backend=backend)  # structural checks only
    assert "undecodable_image" not in loader.skipped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys = [k for b in loader for k in b["keys"]]
        state = loader.state_dict()
    assert "midcorrupt" not in keys and len(set(keys)) == len(keys)
    if backend == "dali":  # the pipeline failed, found the sample, left it out, went on
        assert loader.skipped["undecodable_image"] == 1 and state["excluded"] == {"midcorrupt": "undecodable_image"}
        assert len(keys) == 25 and len(loader) == 5
        with pytest.warns(UserWarning, match="left out 4"):
            resumed = ViewLoader(bad_set, 5, ViewConfig(**TINY), seed=0, backend=backend)
        resumed.load_state_dict(state)  # re-applies the exclusion, so the checkpoint fits
        assert len(resumed) == 5 and len(list(resumed)) == 5
    else:  # PIL drops the unreadable sample from its batch and counts it
        assert len(keys) + loader.skipped.get("unreadable", 0) == 25


def test_a_pipeline_error_that_is_not_a_bad_sample_surfaces(forty, monkeypatch):
    """Only the decoder's error means a bad sample; any other DALI failure is a bug and is raised as is."""
    from nvidia.dali.pipeline import Pipeline

    from relicv2.pretrain.views import dali

    def broken_run(self):
        raise RuntimeError("Critical error in pipeline: Error in CPU operator `nvidia.dali.fn.resize`")

    searched = []
    monkeypatch.setattr(dali, "find_undecodable", lambda samples: searched.append(1) or {})
    loader = ViewLoader(forty, 4, ViewConfig(**TINY), backend="dali")
    iterator = iter(loader)
    monkeypatch.setattr(Pipeline, "run", broken_run)
    with pytest.raises(RuntimeError, match="fn.resize"):
        next(iterator)
    assert searched == []  # no hunt for undecodable samples, no rebuild


def test_a_profile_of_training_shows_each_stage_of_a_dali_batch(forty):
    """A user's torch.profiler trace names where the views' time goes: DALI's run, its outputs, the
    torch colour stage, once a batch each (bench_views.py --profile sums them)."""
    from torch.profiler import ProfilerActivity, profile

    from relicv2.pretrain.views.dali import PROFILE_RANGES, RANGE_COLOUR

    iterator = iter(ViewLoader(forty, 4, ViewConfig(**TINY, ready_batches=0), backend="dali"))
    next(iterator)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        next(iterator)
        next(iterator)
    ranges = [e.name for e in trace.events() if e.name in PROFILE_RANGES]
    assert {name: ranges.count(name) for name in PROFILE_RANGES} == dict.fromkeys(PROFILE_RANGES, 2)
    colour_ops = {e.key for e in trace.events() if e.cpu_parent is not None and e.cpu_parent.name == RANGE_COLOUR}
    assert "aten::index_select" in colour_ops or "aten::lerp" in colour_ops  # the colour steps run inside it


def test_reference_blurs_views_smaller_than_the_blur_kernel(forty):
    views = ViewConfig(**{**TINY, "small_size": 8, "blur_probability_odd": 1.0, "blur_probability_even": 1.0})
    batch = next(iter(ViewLoader(forty, 4, views, backend="reference")))
    assert batch["views"][-1].shape == (4, 3, 8, 8) and torch.isfinite(batch["views"][-1]).all()


def test_bad_arguments_are_clear_errors(forty, tmp_path):
    with pytest.raises(TypeError, match="views must be a ViewConfig"):
        ViewLoader(forty, 4, {"large_views": 3})
    with pytest.raises(ValueError, match="backend must be one of"):
        ViewLoader(forty, 4, backend="pil")
    with pytest.raises(ValueError, match="mask_probability"):
        ViewLoader(forty, 4, ViewConfig(mask_probability=1.5))
    with pytest.raises(ValueError, match="fewer than one batch"):
        ViewLoader(forty, 64)
    with pytest.raises(ValueError, match="no shards"):
        ViewLoader(tmp_path, 4)


def test_auto_threads_are_two_on_a_cpu_and_a_ranks_share_of_the_cores_on_a_gpu(forty, monkeypatch):
    auto = ViewConfig()
    assert auto.num_threads == 0 and loader_threads(auto, "cpu") == CPU_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert loader_threads(auto, "cuda") == GPU_THREADS_MAX  # 16 cores, one GPU: 8, not 15
    assert loader_threads(auto, "cuda:1", {"LOCAL_WORLD_SIZE": "4"}) == 3  # 4 cores a rank, one for the trainer
    assert loader_threads(auto, "cuda", {"LOCAL_WORLD_SIZE": "16"}) == 2  # never fewer than 2
    assert loader_threads(ViewConfig(num_threads=5), "cuda") == 5  # an explicit count is kept
    assert ViewLoader(forty, 4, auto).config.num_threads == CPU_THREADS  # what the pipeline is built with
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        ViewConfig(num_threads=-1)


def test_preview_views_command_writes_a_grid(tmp_path):
    from click.testing import CliRunner

    from relicv2.cli.main import cli

    mask = np.zeros((40, 48), np.uint8)
    mask[5:35, 5:40] = 255
    samples = [ShardSample(f"m{i}", {"jpg": jpeg(i), "mask.png": png(mask)}, None, {}) for i in range(6)]
    write_shard_set(samples, tmp_path / "set", prefix="masked")
    out = tmp_path / "grid.png"
    result = CliRunner().invoke(cli, ["pretrain", "preview-views", "--shards", str(tmp_path / "set"), "--output",
                                      str(out), "--count", "3", "--mask-probability", "1", "--large-size", "32",
                                      "--small-size", "16"])
    assert result.exit_code == 0, result.output
    assert "12 masked" in result.output  # p_m = 1: all 4 large views of the 3 images
    grid = np.asarray(Image.open(out))
    assert grid.shape == (4 + 3 * 36, 4 + 6 * 36, 3)
    assert (grid == (255, 140, 0)).all(axis=-1).sum() > 4 * 3 * 4 * 32  # orange frames drawn
    missing = CliRunner().invoke(cli, ["pretrain", "preview-views", "--shards", str(tmp_path), "--output", str(out)])
    assert missing.exit_code != 0 and "no shards" in missing.output

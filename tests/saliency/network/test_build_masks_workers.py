"""`saliency build-masks` worker processes: their shared-memory ring is removed whatever happens to the job
(done, failed, killed), workers that die are one clear error and the rerun resumes, a `/dev/shm` too small
is refused up front, and a job killed with SIGKILL leaves no worker and no ring behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from relicv2.saliency.network import mask_work
from relicv2.saliency.network.build_masks import BuildMasksConfig, MasksError, build_masks
from relicv2.saliency.network.mask_work import RING_SLOTS, SlotRing, ring_bytes
from relicv2.shards import write_shard_set
from relicv2.shards.build import Ranks
from tests.paths import REPO
from tests.saliency.network.conftest import SquarePredictor, scene_samples

SHM = Path(mask_work.SHM_FOLDER)
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason=f"no {SHM} on this system")


def _rings(pid: int) -> list[str]:
    """The shared blocks in /dev/shm made by process `pid`: its ring and the record of its semaphores."""
    return sorted(p.name for p in SHM.glob(f"relicv2-masks-{pid}-*"))


def _config(model: Path, shards: Path, out: Path, workers: int = 2) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=workers, batch_size=3, progress=False)


def _files(folder: Path) -> dict[str, bytes]:
    """The masked set's files (config.yaml names the job's own folder and settings: left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "config.yaml"}


def test_ring_block_is_shared_with_an_attached_copy_and_removed_on_release() -> None:
    ring = SlotRing.create(batch=3, size=5)
    try:
        other = SlotRing.attach(ring.spec)  # what a worker does
        other.squares(2)[1] = 7
        other.probabilities(1)[0, 4, 4] = 0.25
        assert ring.squares(2)[1].min() == 7 and ring.squares(2)[0].max() == 0 and ring.squares(1).max() == 0
        assert ring.probabilities(1)[0, 4, 4] == np.float32(0.25) and ring.probabilities(0).max() == 0
        assert ring.memory.size >= ring_bytes(3, 5) == 3 * 3 * 5 * 5 * 7
        del other
    finally:
        ring.release()
    if SHM.is_dir():
        assert _rings(os.getpid()) == []
    with pytest.raises(FileNotFoundError):
        SlotRing.attach(ring.spec)


def test_odd_batch_and_size_keep_the_maps_aligned() -> None:
    ring = SlotRing.create(batch=3, size=7)  # 3 x 7 x 7 x 3 bytes of squares: not a multiple of 4
    try:
        for slot in range(RING_SLOTS):
            assert ring.probabilities(slot).ctypes.data % 4 == 0
            assert ring.probabilities(slot).shape == (3, 7, 7) and ring.squares(slot).shape == (3, 7, 7, 3)
    finally:
        ring.release()


@needs_shm
def test_too_little_shared_memory_is_refused_before_the_output_exists(tmp_path, scene_shards, tiny_model,
                                                                       monkeypatch) -> None:
    shards, _ = scene_shards
    real = os.statvfs(SHM)

    class Small:  # 1 MiB free in /dev/shm, like a container started without --shm-size
        f_frsize, f_bavail = real.f_frsize, 2**20 // real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda folder: Small())
    config = BuildMasksConfig(model=tiny_model, shards=shards, out=tmp_path / "out", workers=1, batch_size=64,
                              progress=False)
    with pytest.raises(MasksError, match=r"/dev/shm has 1 MiB free .*--batch.*--ipc=host"):
        build_masks(config, Ranks(), predictor=SquarePredictor())
    assert not (tmp_path / "out").exists()


@needs_shm
def test_room_for_every_local_ranks_ring_is_required(tmp_path, scene_shards, tiny_model, monkeypatch) -> None:
    shards, _ = scene_shards
    real = os.statvfs(SHM)
    one_ring = ring_bytes(64, SquarePredictor.size)

    class RoomForTwo:
        f_frsize, f_bavail = real.f_frsize, 2 * one_ring // real.f_frsize + 1

    monkeypatch.setattr(os, "statvfs", lambda folder: RoomForTwo())
    config = BuildMasksConfig(model=tiny_model, shards=shards, out=tmp_path / "out", workers=0, batch_size=64,
                              progress=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's 4 ranks on this node: 4 rings
    with pytest.raises(MasksError, match="lower --batch"):
        build_masks(config, Ranks(), predictor=SquarePredictor())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert build_masks(config, Ranks(), predictor=SquarePredictor())["written"] == 12


@needs_shm
def test_ring_is_removed_after_a_job_and_after_a_failed_one(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    build_masks(_config(tiny_model, shards, tmp_path / "done"), Ranks(), predictor=SquarePredictor())
    assert _rings(os.getpid()) == []

    class Fails(SquarePredictor):
        def __call__(self, squares):
            raise RuntimeError("the network failed")

    with pytest.raises(RuntimeError, match="the network failed"):
        build_masks(_config(tiny_model, shards, tmp_path / "failed"), Ranks(), predictor=Fails())
    assert _rings(os.getpid()) == []


class _KillsTheWorkers(SquarePredictor):
    """Kills the job's worker processes at its third batch (inside the second shard), as the kernel's
    out-of-memory killer would. All of them: a pool that keeps one worker may finish the job on it before
    it notices the death, which is a finished job, not the error path under test. Only the children that
    appeared after `before` are the job's (another test's pool may still be exiting in this process)."""

    def __init__(self, before: set[int]) -> None:
        self.calls, self.before = 0, before

    def __call__(self, squares):
        self.calls += 1
        if self.calls == 3:
            workers = [p for p in multiprocessing.active_children() if p.pid not in self.before]
            assert workers, "the job runs no worker process"
            for worker in workers:
                os.kill(worker.pid, signal.SIGKILL)
            for worker in workers:
                worker.join(5)
        return super().__call__(squares)


def test_killed_workers_are_one_clear_error_and_the_rerun_resumes(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(MasksError, match=r"a worker process died while saliency build-masks made .*masked-000001.tar .*rerun the same command to resume"):
        build_masks(_config(tiny_model, shards, tmp_path / "resumed"), Ranks(), predictor=_KillsTheWorkers(before))
    assert (tmp_path / "resumed" / "masked-000000.tar").is_file()  # the shard finished before is kept
    summary = build_masks(_config(tiny_model, shards, tmp_path / "resumed"), Ranks(), predictor=SquarePredictor())
    assert (summary["shards_kept"], summary["shards_built"], summary["written"]) == (1, 2, 12)
    build_masks(_config(tiny_model, shards, tmp_path / "whole", workers=0), Ranks(), predictor=SquarePredictor())
    assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):  # the process ended while listed
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # a zombie waiting for init to reap it is gone too


def _masks_command(model: Path, shards: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "relicv2", "saliency", "build-masks", "--model", str(model), "--shards", str(shards),
            "--out", str(out), "--workers", "2", "--batch", "1", "--no-progress"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not SHM.is_dir(), reason="reads /proc and /dev/shm")
def test_killed_job_leaves_no_worker_and_no_ring_and_resumes_byte_identical(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(48, height=120, width=160)
    shards = tmp_path / "in"
    write_shard_set(samples, shards, max_count=4)  # 12 shards
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(_masks_command(tiny_model, shards, tmp_path / "killed"), cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = tmp_path / "killed" / ".build-masks"
    deadline = time.monotonic() + 120
    while not (records / "000001.done.json").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [pid for pid in _children(job.pid) if Path(f"/proc/{pid}/cmdline").read_bytes().count(b"spawn_main")]
    rings = _rings(job.pid)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    assert len(list(records.glob("0*.done.json"))) < 12, "the job ended before it was killed: give it more work"
    assert 1 <= len(workers) <= 2 and len(rings) == 2  # the pool starts its processes as work comes
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not (all(map(_gone, workers)) and _rings(job.pid) == []):
        time.sleep(0.1)
    assert all(map(_gone, workers)), "a worker outlived the killed job"
    assert _rings(job.pid) == [], "the killed job's ring stayed in /dev/shm"

    # Resumed, and run whole, here: one torch thread, as in the job (OMP_NUM_THREADS=1), so the same network output.
    def run(out: Path) -> dict:
        return build_masks(BuildMasksConfig(model=tiny_model, shards=shards, out=out, workers=1, batch_size=1,
                                            progress=False), Ranks())

    assert run(tmp_path / "killed")["shards_kept"] >= 2
    run(tmp_path / "whole")
    assert _files(tmp_path / "killed") == _files(tmp_path / "whole")


def test_a_worker_imports_neither_torch_nor_the_handcrafted_methods():
    # Each spawned worker imports `mask_work` before its first task: what that pulls in is on the path to the
    # job's first batch (the handcrafted methods and numba doubled it, torch would add seconds).
    heavy = ("torch", "numba", "relicv2.saliency.handcrafted.methods", "relicv2.saliency.network.config")
    code = f"import sys, saliency.network.mask_work; print([m for m in {heavy!r} if m in sys.modules])"
    found = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.strip()
    assert found == "[]", f"a build-masks worker imports {found}"


def test_rehash_shards_rebuilds_a_masked_shard_whose_bytes_rotted(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "masked"
    build_masks(_config(tiny_model, shards, out, workers=0), Ranks(), predictor=SquarePredictor())
    before = _files(out)
    tar = out / "masked-000001.tar"
    stat = tar.stat()
    data = bytearray(tar.read_bytes())
    data[1500] ^= 0x01
    tar.write_bytes(bytes(data))
    os.utime(tar, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and time as recorded: only a hash tells
    summary = build_masks(_config(tiny_model, shards, out, workers=0), Ranks(), predictor=SquarePredictor())
    assert summary["shards_built"] == 0  # a plain rerun reads no finished tar
    config = BuildMasksConfig(**{**_config(tiny_model, shards, out, workers=0).__dict__, "rehash_shards": True})
    summary = build_masks(config, Ranks(), predictor=SquarePredictor())
    assert summary["shards_built"] == 1 and _files(out) == before

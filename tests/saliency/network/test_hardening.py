"""Hand-made model files, unwritable outputs and odd limits: one line each, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.saliency.network import mask_work
from relicv2.saliency.network.build_masks import STATE_DIR, BuildMasksConfig, build_masks
from relicv2.saliency.network.mask_work import RingSpaceError, check_shm_space
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import ModelFileError, load_model, save_model
from relicv2.shards import write_shard_set
from relicv2.shards.build import Ranks
from relicv2.shards.job import RECORD_SUFFIX
from tests.paths import REPO
from tests.saliency.network.conftest import scene_samples
from tests.unwritable import immutable

TRAIN = ["--preset", "tiny", "--no-progress", "--set", "methods=mc", "--set", "num_images=4",
         "--set", "epochs=1", "--set", "fuse_epochs=1", "--backbone", "random"]


def _one_line(result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # a click error, not a traceback
    assert all(word in result.output for word in words), result.output


def test_train_refuses_an_out_that_is_a_file_or_unwritable(tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards
    blocker = tmp_path / "out"
    blocker.write_text("a file")
    as_file = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(blocker), *TRAIN])
    _one_line(as_file, "--out", "is a file")
    folder = tmp_path / "runs"
    folder.mkdir()
    with immutable(folder):
        locked = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(folder / "a"),
                                          *TRAIN])
    _one_line(locked, "--out", "not writable")


def test_train_on_a_disk_that_fills_is_one_line_naming_the_work_file(tmp_path: Path, scene_shards,
                                                                     monkeypatch) -> None:
    from tests.models.test_torchfile import fill_the_disk

    shards, _ = scene_shards
    fill_the_disk(monkeypatch)
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(tmp_path / "o"),
                                      *TRAIN])
    _one_line(result, str(tmp_path / "o" / "work"), ".current.pt: No space left on device")
    assert "inline_container" not in result.output


def _hand_made(tmp_path: Path, **changes) -> Path:
    path = save_model(tmp_path / "model.pt", SaliencyNet(18).eval(), input_size=32, preset="tiny",
                      backbone="random", config={}, report={})
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    torch.save(payload, path)
    return path


@pytest.mark.parametrize("changes", [
    {"arch": ["dilated-resnet-os8-decoder-v1", 18, 1]},
    {"arch": "dilated-resnet-os8-decoder-v1"},
    {"arch": {"name": "dilated-resnet-os8-decoder-v1", "depth": "18", "width": 1}},
    {"arch": {"name": "dilated-resnet-os8-decoder-v1", "depth": 19, "width": 1}},
    {"state_dict": [torch.zeros(3)]},
    {"state_dict": {"encoder.conv1.weight": [1.0]}},
], ids=["arch list", "arch string", "depth string", "depth 19", "state_dict list", "weight a list"])
def test_a_hand_made_model_file_is_one_clear_error(tmp_path: Path, changes: dict) -> None:
    path = _hand_made(tmp_path, **changes)
    with pytest.raises(ModelFileError, match=str(path)) as raised:
        load_model(path)
    assert "saliency train" in str(raised.value)


def test_a_model_file_of_an_absurd_input_size_is_refused_before_anything_is_sized_by_it(tmp_path: Path,
                                                                                        scene_shards) -> None:
    """Not the shared memory nor --batch is blamed: the file's size is impossible."""
    shards, _ = scene_shards
    for size in (10**6, 0, 36):
        path = _hand_made(tmp_path, input_size=size)
        result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(path), "--shards", str(shards),
                                          "--out", str(tmp_path / "out"), "--batch", "1", "--workers", "0",
                                          "--device", "cpu", "--no-progress"])
        _one_line(result, str(path), "impossible input size", "multiple of 8", "saliency train")
        assert "/dev/shm" not in result.output and "--batch" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_model_of_another_depth_names_a_key_and_the_depth_setting(tmp_path: Path) -> None:
    deeper = {k: v for k, v in SaliencyNet(34).state_dict().items()}
    path = _hand_made(tmp_path, state_dict=deeper)  # weights of a ResNet-34, arch says 18
    with pytest.raises(ModelFileError) as raised:
        load_model(path)
    message = str(raised.value)
    assert "unexpected" in message and "encoder.layer1.2." in message  # a block ResNet-18 does not have
    assert "ResNet-18" in message and "depth or width" in message


def test_the_shared_memory_refusal_prints_sizes_that_are_not_rounded_to_zero(monkeypatch) -> None:
    real = os.statvfs("/")

    class HalfAMebibyte:
        f_frsize, f_bavail = real.f_frsize, 2**19 // real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda folder: HalfAMebibyte())
    with pytest.raises(RingSpaceError, match=r"has 512 KiB free but build-masks needs 1 MiB"):
        check_shm_space(2**20, "/dev/shm")


def _second_record(out: Path) -> Path:
    """The done record of the job's second shard: once it exists the job is busy, with work left."""
    return out / STATE_DIR / f"{1:06d}{RECORD_SUFFIX}"


def _rings_of(pid: int) -> list[Path]:
    return sorted(p for p in Path(mask_work.SHM_FOLDER).glob(f"relicv2-masks-{pid}-*")
                  if mask_work.RING_NAME.fullmatch(p.name))


def _semaphores_of(pid: int) -> list[Path]:
    """The semaphore files of the job's worker pool, as its record in /dev/shm names them."""
    records = [p for p in Path(mask_work.SHM_FOLDER).glob(f"relicv2-masks-{pid}-*")
               if mask_work.SEMAPHORES_NAME.fullmatch(p.name)]
    names = [name for record in records for name in record.read_text().split()]
    return [Path(mask_work.SHM_FOLDER) / f"sem.{name.lstrip('/')}" for name in names]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path(mask_work.SHM_FOLDER).is_dir(),
                    reason="needs /dev/shm")
def test_a_rerun_removes_the_ring_of_a_job_killed_with_its_process_group(tmp_path: Path, tiny_model: Path) -> None:
    samples, _ = scene_samples(48, height=120, width=160)
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards, max_count=4)  # 12 shards
    command = [sys.executable, "-m", "relicv2", "saliency", "build-masks", "--model", str(tiny_model), "--shards",
               str(shards), "--out", str(out), "--workers", "2", "--batch", "1", "--no-progress"]
    # Its own session: the kill takes the job, its workers and multiprocessing's resource tracker at once
    # (as scancel, docker kill or an OOM kill of the cgroup do).
    job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _second_record(out).exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        time.sleep(0.5)
        assert len(_rings_of(job.pid)) == 1, "the group kill left no ring: nothing to test"
        semaphores = _semaphores_of(job.pid)
        assert semaphores and all(p.exists() for p in semaphores), "the group kill left no semaphore: nothing to test"
        summary = build_masks(BuildMasksConfig(model=tiny_model, shards=shards, out=out, workers=1, batch_size=1,
                                               progress=False), Ranks())
        assert summary["shards_kept"] >= 2
        assert _rings_of(job.pid) == [], "the killed job's ring stayed in /dev/shm after the rerun"
        assert [p for p in semaphores if p.exists()] == [], "the killed job's semaphores stayed after the rerun"
        assert list(Path(mask_work.SHM_FOLDER).glob(f"relicv2-masks-{job.pid}-*")) == []  # their record too
        assert list(Path(mask_work.SHM_FOLDER).glob(f"relicv2-masks-{os.getpid()}-*")) == []  # the rerun's went
    finally:
        for leftover in Path(mask_work.SHM_FOLDER).glob(f"relicv2-masks-{job.pid}-*"):
            leftover.unlink()


_FULL_SHM = """
import os
from relicv2.saliency.network.mask_work import RingSpaceError, SlotRing
try:
    SlotRing.create(batch=64, size=128)  # 22 MiB, in a 4 MiB /dev/shm
    print("created")
except RingSpaceError as error:
    print("refused:", error)
print("left:", sorted(os.listdir("/dev/shm")))
"""


def test_a_ring_that_does_not_fit_in_dev_shm_is_refused_when_made(tmp_path: Path) -> None:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=4m tmpfs /dev/shm"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a small /dev/shm here (needs unshare and mount rights)")
    job = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "{sys.executable}" -c "$0"', _FULL_SHM],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    assert "refused: /dev/shm cannot hold the 21 MiB" in job.stdout and "--batch" in job.stdout, job.stdout
    assert "left: []" in job.stdout  # the refused block is removed


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a process group")
def test_ctrl_c_is_one_line_and_exit_130_without_a_traceback_from_any_worker(tmp_path: Path, tiny_model: Path) -> None:
    samples, _ = scene_samples(96, height=120, width=160)  # 24 shards: the job is far from done when it is stopped
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards, max_count=4)
    command = [sys.executable, "-m", "relicv2", "saliency", "build-masks", "--model", str(tiny_model), "--shards",
               str(shards), "--out", str(out), "--workers", "2", "--batch", "1", "--no-progress"]
    job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _second_record(out).exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    try:
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


@pytest.mark.parametrize("batch", ["0", "-5"])
def test_a_batch_under_one_is_refused(tmp_path: Path, tiny_model: Path, scene_shards, batch: str) -> None:
    shards, _ = scene_shards
    result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(tiny_model), "--shards", str(shards),
                                      "--out", str(tmp_path / "out"), "--batch", batch, "--no-progress"])
    assert result.exit_code == 2, result.output  # a usage error, not a silent batch of 1
    assert "Invalid value for '--batch'" in result.output and f"{batch} is not in the range" in result.output
    assert not (tmp_path / "out").exists()


def test_more_workers_than_can_be_busy_are_lowered_and_said(tmp_path: Path, tiny_model: Path, scene_shards) -> None:
    shards, _ = scene_shards
    result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(tiny_model), "--shards", str(shards),
                                      "--out", str(tmp_path / "out"), "--batch", "2", "--workers", "100000",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "--workers 100000 lowered to" in result.output
    assert "100000 worker process" not in result.output


def test_a_backbone_sidecar_with_a_depth_that_is_not_a_number_is_one_clear_error(tmp_path: Path) -> None:
    from relicv2.models.resnet import resnet
    from relicv2.saliency.network.weights import BackboneError, encoder_state_dict

    weights = tmp_path / "r18.pt"
    torch.save(resnet(18).state_dict(), weights)
    (tmp_path / "r18.pt.json").write_text('{"depth": "eighteen", "width": 1}')
    with pytest.raises(BackboneError, match=r"r18.pt.json.*not whole numbers"):
        encoder_state_dict(weights, 18, 1)

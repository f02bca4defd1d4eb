"""SIGINT / SIGTERM sent to the main process of a job with workers: the job and its workers end within seconds.

Each job runs as `python -m relicv2 ...` in its own session on tiny data. The signal goes to the main pid
only (what `timeout`, `kill` and schedulers do), the workers never see it. The job must exit with
130 (SIGINT) or 143 (SIGTERM), print one line saying so, and leave no process of its session alive.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relicv2.shards import ShardSample, write_shard_set
from tests.paths import CONFIGS, REPO

STOP_WITHIN_S = 12.0  # the job's own grace period (cli.signals.GRACE_S) and a little more
START_WITHIN_S = 120.0  # a busy shared machine starts python, torch and the pools slowly


def _session_processes(sid: int) -> dict[int, str]:
    """{pid: state} of the processes of session `sid` that are still alive (zombies are dead)."""
    alive = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            alive[int(entry.name)] = state
    return alive


def _children(pid: int) -> int:
    return sum(1 for p in _session_processes(pid) if p != pid and _parent(p) == pid)


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2:].split()[1])


def stop_job(args: list[str], signum: int, *, ready: str, workers: int = 2) -> tuple[int, str]:
    """Run `relicv2 ARGS` until its output shows `ready` and it has `workers` child processes, send
    `signum` to its main pid, and return (exit code, output); no process of its session may survive."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "-m", "relicv2", *args], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = io.StringIO()
    reader = threading.Thread(target=lambda: [output.write(line) for line in job.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while not (ready in output.getvalue() and _children(job.pid) >= workers):
            assert job.poll() is None, f"the job ended before it was signalled:\n{output.getvalue()}"
            assert time.monotonic() < deadline, f"the job never got busy:\n{output.getvalue()}"
            time.sleep(0.05)
        os.kill(job.pid, signum)
        try:
            code = job.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_WITHIN_S} s after {signal.Signals(signum).name}:\n{output.getvalue()}")
        deadline = time.monotonic() + 3.0  # the kernel may take a moment to reap killed workers
        while _session_processes(job.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _session_processes(job.pid), f"processes outlived the job: {_session_processes(job.pid)}"
        reader.join(5.0)
        return code, output.getvalue()
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()


def _stopped_line(signum: int) -> str:
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"


def _noise_jpeg(path: Path, side: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path, quality=90)


def _scene_shards(folder: Path, count: int, side: int = 64) -> Path:
    from tests.scenes import synthetic_scene

    samples = []
    for i in range(count):
        rgb, _ = synthetic_scene(side, side, seed=i)
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, "JPEG", quality=90)
        samples.append(ShardSample(f"s{i:04d}", {"jpg": buffer.getvalue()}, i % 2, {"width": side, "height": side}))
    write_shard_set(samples, folder, max_count=16)
    return folder


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_shards_build(tmp_path, signum):
    images = tmp_path / "images"
    images.mkdir()
    _noise_jpeg(images / "a0.jpg", 1600, 0)
    for i in range(1, 400):  # one large picture many times over: seconds of decoding for two workers
        os.link(images / "a0.jpg", images / f"a{i}.jpg")
    code, output = stop_job(["shards", "build", str(images), str(tmp_path / "out"), "--workers", "2",
                             "--no-progress"], signum, ready="")
    assert code == 128 + signum and _stopped_line(signum) in output, output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_saliency_handcrafted(tmp_path, signum):
    shards = _scene_shards(tmp_path / "scenes", 24, side=96)
    code, output = stop_job(["saliency", "handcrafted", "--method", "dsr", "--input", str(shards), "--output",
                             str(tmp_path / "maps"), "--workers", "2", "--no-progress"], signum, ready="")
    assert code == 128 + signum and _stopped_line(signum) in output, output


@pytest.mark.slow
def test_saliency_train_in_the_crf_phase(tmp_path, signum=signal.SIGINT):
    shards = _scene_shards(tmp_path / "scenes", 16)
    code, output = stop_job(["saliency", "train", "--shards", str(shards), "--out", str(tmp_path / "net"),
                             "--preset", "tiny", "--backbone", "random", "--set", "workers=2", "--set",
                             "methods=[mr]", "--set", "num_images=16", "--set", "epochs=500", "--no-progress"],
                            signum, ready="saliency train: 16 images")
    assert code == 128 + signum and _stopped_line(signum) in output, output


def test_build_masks(tmp_path, signum=signal.SIGTERM):
    import torch

    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model

    torch.manual_seed(0)
    model = save_model(tmp_path / "model.pt", SaliencyNet(18).eval(), input_size=224, preset="tiny",
                       backbone="random initialisation", config={}, report={})
    shards = _scene_shards(tmp_path / "scenes", 160)
    code, output = stop_job(["saliency", "build-masks", "--model", str(model), "--shards", str(shards), "--out",
                             str(tmp_path / "masked"), "--workers", "2", "--batch", "4", "--device", "cpu",
                             "--no-progress"], signum, ready="")
    assert code == 128 + signum and _stopped_line(signum) in output, output


@pytest.mark.slow
def test_pretrain_with_loader_workers(tmp_path, signum=signal.SIGTERM):
    shards = _scene_shards(tmp_path / "scenes", 32)
    code, output = stop_job([
        "pretrain", "--config", str(CONFIGS / "demo-cpu.yaml"), "--output", str(tmp_path / "run"),
        "--set", "data.source=shards", "--set", f"data.train_shards={shards}", "--set", "views.backend=reference",
        "--set", "views.num_threads=2", "--set", "views.mask_probability=0.0", "--set", "views.large_size=32",
        "--set", "views.small_size=16", "--set", "model.hidden_dim=32", "--set", "model.out_dim=16",
        "--set", "optim.global_batch=8", "--set", "loss.num_negatives=7",
        "--set", "optim.epochs=1000", "--set", "knn.train_shards=", "--set", "knn.val_shards=",
        "--set", "run.device=cpu", "--set", "run.progress_bar=false", "--set", "run.log_every=1",
    ], signum, ready="")
    assert code == 128 + signum, output
    assert f"stopped by {signal.Signals(signum).name}" in output

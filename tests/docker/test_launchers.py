"""The torchrun and SLURM launchers: dry runs, usage lines, and real 2-process CPU runs of both jobs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relicv2.pretrain.config import PretrainConfig
from tests.paths import CONFIGS, REPO
from tests.slurm import fake_scontrol

TORCHRUN = REPO / "docker" / "torchrun.sh"
SBATCH = REPO / "docker" / "slurm.sbatch"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, **kwargs)


def test_torchrun_dry_run_single_node_is_standalone_with_restarts():
    result = _run([str(TORCHRUN), "--dry-run", "pretrain", "--config", "demo-cpu"], _env())
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith(f"{sys.executable} -m torch.distributed.run ")
    assert "--standalone" in line and "--max-restarts=3" in line and "--nproc-per-node=gpu" in line
    assert line.endswith("-m relicv2 pretrain --config demo-cpu")


def test_torchrun_default_one_process_per_gpu_without_a_gpu_is_one_line_naming_the_fix():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here: the default is valid")
    result = _run([str(TORCHRUN), "shards", "verify", "nowhere"], _env())
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no GPU is visible; set NPROC_PER_NODE=N" in result.stderr


def test_torchrun_dry_run_multi_node_uses_c10d_rendezvous_and_needs_an_endpoint():
    args = [str(TORCHRUN), "saliency", "build-masks", "--model", "m.pt", "--shards", "in", "--out", "out"]
    result = _run(args, _env(DRY_RUN="1", NNODES="4", RDZV_ENDPOINT="node01:29500", RDZV_ID="77",
                             MAX_RESTARTS="5", NPROC_PER_NODE="8"))
    assert result.returncode == 0, result.stderr
    line = result.stdout
    for part in ("--nnodes=4", "--nproc-per-node=8", "--max-restarts=5", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=node01:29500", "--rdzv-id=77", "-m relicv2 saliency build-masks --model m.pt"):
        assert part in line
    assert "--standalone" not in line
    missing = _run(args, _env(DRY_RUN="1", NNODES="2"))
    assert missing.returncode == 2 and "RDZV_ENDPOINT" in missing.stderr


@pytest.fixture()
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """An environment with a stand-in `scontrol` that expands a bracketed node list as SLURM does."""
    bin_dir = fake_scontrol(tmp_path / "bin")
    return _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[07-10]", SLURM_NNODES="4",
                SLURM_JOB_ID="4242", SRUN_ARGS="--container-image=relicv2.sqsh --container-mounts=/data:/data")


def test_slurm_dry_run_picks_the_head_node_and_launches_one_task_per_node(fake_slurm: dict[str, str]):
    result = _run([str(SBATCH), "--dry-run", "pretrain", "--config", "imagenet-r50-1000ep",
                   "--set", "data.train_shards=/data/shards/masked-train"], fake_slurm)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "head node gpu07, 4 node(s), rendezvous gpu07:29500 (id 4242)" in out
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--nodes=4" in srun and "--ntasks-per-node=1" in srun
    assert "--container-image=relicv2.sqsh" in srun and "docker/torchrun.sh pretrain" in srun
    node = next(line for line in out.splitlines() if "torch.distributed.run" in line)
    assert "--nnodes=4" in node and "--rdzv-endpoint=gpu07:29500" in node and "--rdzv-id=4242" in node


def test_slurm_script_asks_for_a_signal_before_the_time_limit_and_requeues():
    header = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert header["ntasks-per-node"] == "1"
    assert re.fullmatch(r"B:TERM@\d+", header["signal"]), header["signal"]
    assert "requeue" in header
    text = SBATCH.read_text()
    assert "scontrol requeue" in text and "trap" in text


def _valid_keys(cls: type = PretrainConfig, prefix: str = "") -> set[str]:
    keys = set()
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.type) or isinstance(field.default_factory, type):
            keys |= _valid_keys(field.default_factory, f"{prefix}{field.name}.")
        else:
            keys.add(f"{prefix}{field.name}")
    return keys


def test_usage_lines_name_valid_pretrain_keys():
    keys = _valid_keys()
    assert "data.train_shards" in keys and "run.output_dir" in keys
    files = [TORCHRUN, SBATCH, REPO / "docker" / "Dockerfile", REPO / "scripts" / "demo.sh",
             *sorted((REPO / "docs").glob("*.md"))]
    seen = 0
    for path in files:
        for key in re.findall(r"--set[ =]\"?([a-z_]+\.[a-z_.]+)=", path.read_text()):
            seen += 1
            if key.split(".")[0] in ("model", "data", "views", "loss", "optim", "run", "knn"):
                assert key in keys, f"{path.name} names the unknown config key {key}"
    assert seen >= 3


@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory) -> Path:
    """The demo images as shards, made once for the launcher runs of this module (in this process: the
    launchers are under test, not these commands, and a process of their own would import torch again)."""
    from click.testing import CliRunner

    from relicv2.cli.main import cli

    root = tmp_path_factory.mktemp("launch")
    for args in (["demo-data", str(root / "images"), "--train-per-class", "4", "--val-per-class", "1", "--size", "64"],
                 ["shards", "build", str(root / "images" / "train"), str(root / "shards"), "--max-count", "9",
                  "--workers", "1", "--no-progress"]):
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return root / "shards"


@pytest.mark.slow
def test_launcher_runs_pretrain_on_two_cpu_processes(tmp_path: Path, demo_shards: Path):
    shards = demo_shards
    run = tmp_path / "run"
    overrides = {"data.train_shards": shards, "knn.train_shards": "", "knn.val_shards": "", "run.device": "cpu",
                 "run.max_steps": 2, "run.progress_bar": "false", "optim.global_batch": 8,
                 "views.large_size": 32, "views.small_size": 16, "views.blur_kernel": 3, "views.num_threads": 1,
                 "model.hidden_dim": 64, "model.out_dim": 32, "loss.num_negatives": 7}
    args = [str(TORCHRUN), "pretrain", "--config", str(CONFIGS / "demo-cpu.yaml"), "--output", str(run)]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    result = _run(args, _env(NPROC_PER_NODE="2", MAX_RESTARTS="0"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("done: 2 steps") == 2  # both ranks finished
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    payload = torch.load(run / "checkpoint-000000002.pt", weights_only=True)
    assert payload["step"] == 2 and len(payload["data"]) == 2  # one data-pipeline state per rank


@pytest.mark.slow
def test_launcher_runs_build_masks_on_two_cpu_processes(tmp_path: Path, demo_shards: Path):
    # A random tiny model file is enough here: the launcher and the rank split are under test, and
    # `saliency train` itself is tested in tests/saliency/network.
    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model

    shards = demo_shards
    torch.manual_seed(0)
    model = save_model(tmp_path / "saliency" / "model.pt", SaliencyNet(18).eval(), input_size=32, preset="tiny",
                       backbone="random initialisation", config={}, report={})
    out = tmp_path / "masked"
    result = _run([str(TORCHRUN), "saliency", "build-masks", "--model", str(model),
                   "--shards", str(shards), "--out", str(out), "--device", "cpu", "--workers", "1"],
                  _env(NPROC_PER_NODE="2", MAX_RESTARTS="0"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import pyarrow.parquet as pq

    source = pq.read_table(shards / "manifest.parquet").column("key").to_pylist()
    masked = pq.read_table(out / "manifest.parquet").column("key").to_pylist()
    assert sorted(masked) == sorted(source)  # the two ranks together covered every sample once
    assert sorted(out.glob("masked-*.tar"))

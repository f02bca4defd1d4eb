"""Shared pretraining fixtures: a tiny generated-data config and one finished run reused by several modules."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from relicv2.pretrain.config import PretrainConfig, load_config
from relicv2.pretrain.run import run_pretraining
from tests.threads import one_torch_thread

RESUME_OPTIONS = ("optim.epochs=2", "run.checkpoint_every=2", "run.keep_checkpoints=2")


def tiny_config(out: Path, *extra: str) -> PretrainConfig:
    """ResNet-18 with small heads at 16/8 px, 2 + 1 views, 8 images per step, on generated data."""
    return load_config(None, [
        "data.source=synthetic", "data.synthetic_images=32", "data.synthetic_classes=4",
        "model.depth=18", "model.hidden_dim=32", "model.out_dim=16",
        "views.large_views=2", "views.small_views=1", "views.large_size=16", "views.small_size=8",
        "optim.global_batch=8", "optim.epochs=3", "optim.warmup_epochs=1", "optim.base_lr=1.0",
        "loss.num_negatives=3", f"run.output_dir={out}", "run.device=cpu", "run.log_every=1",
        "run.progress_bar=false", "run.checkpoint_every=3", "run.keep_checkpoints=5", *extra,
    ])


def quiet_run(config: PretrainConfig, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return run_pretraining(config, **kwargs)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """An uninterrupted 8-step run (2 epochs of 4 steps), checkpoints every 2 steps, the last 2 kept."""
    out = tmp_path_factory.mktemp("whole")
    with one_torch_thread():
        quiet_run(tiny_config(out, *RESUME_OPTIONS), auto_resume=False)
    return out

"""One reading of a device setting for every job: the same choice and the same refusal everywhere."""

from __future__ import annotations

import pytest
import torch

from relicv2.jobs.config import ConfigError
from relicv2.jobs.device import resolve_device
from relicv2.pretrain.distributed import describe_environment

BAD = "is not a device; use auto, cpu, cuda or cuda:N"


def test_a_bad_device_string_is_one_refusal_naming_the_setting():
    with pytest.raises(ConfigError, match=f"^--device tpu {BAD}$"):
        resolve_device("tpu", "--device")
    with pytest.raises(ConfigError, match=f"^device=cuda:x {BAD}$"):
        resolve_device("cuda:x")
    # The pretraining context reads it the same way (it used to run a misspelt device on the CPU).
    with pytest.raises(RuntimeError, match=f"^run.device=gpu {BAD}$"):
        describe_environment("gpu", env={})


def test_auto_is_this_ranks_gpu_when_one_is_visible_else_the_cpu():
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("auto", local_rank=0) == "cuda:0"
        assert describe_environment("cuda", env={}).device == torch.device("cuda", 0)
        with pytest.raises(ConfigError, match="this machine has"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        assert resolve_device("auto") == "cpu" and describe_environment("auto", env={}).backend == "gloo"
        with pytest.raises(ConfigError, match="^--device cuda:1: no CUDA device is visible; use cpu or auto$"):
            resolve_device("cuda:1", "--device")

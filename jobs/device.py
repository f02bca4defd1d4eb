"""The device a job runs on: the one reading of a device setting ("auto", "cpu", "cuda", "cuda:N")."""

from __future__ import annotations

import re

from relicv2.jobs.config import ConfigError
from relicv2.jobs.ranks import ranks_from_env

CUDA = re.compile(r"cuda(?::(\d+))?")


def resolve_device(device: str, option: str = "device", *, local_rank: int | None = None) -> str:
    """The torch device for the setting `device`: "auto" is this rank's GPU when CUDA is visible, else "cpu";
    "cuda" is this rank's GPU (`local_rank`, default torchrun's LOCAL_RANK); "cuda:N" the N-th. Anything else,
    or a GPU this machine lacks, is a ConfigError naming `option` (a flag such as "--device" or a key such as
    "run.device") and the fix. Imports torch only when called."""
    import torch  # here: jobs stays importable without torch (`--help`, the shard tools)

    shown = f"{option} {device}" if option.startswith("--") else f"{option}={device}"
    match = CUDA.fullmatch(device)
    if device not in ("auto", "cpu") and match is None:
        raise ConfigError(f"{shown} is not a device; use auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and count == 0):
        return "cpu"
    if count == 0:
        raise ConfigError(f"{shown}: no CUDA device is visible; use cpu or auto")
    index = int(match[1]) if match and match[1] else (ranks_from_env().local_rank if local_rank is None else local_rank)
    if index >= count:
        raise ConfigError(f"{shown}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"

"""This process's place in a torchrun job: the one reader of RANK, WORLD_SIZE and LOCAL_RANK (torchrun's,
or a SLURM wrapper's that mimics it); unset means a single process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class RanksError(ValueError):
    """RANK / WORLD_SIZE / LOCAL_RANK are set to something that cannot be a torchrun job."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process job (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def _int(env: Mapping[str, str], name: str, default: str) -> int:
    text = env.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise RanksError(f"{name}={text!r} is not an integer; launch with torchrun or unset {name}") from None


def ranks_from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """Ranks from torchrun's environment; a single process (0 of 1) when unset."""
    env = os.environ if env is None else env
    ranks = Ranks(_int(env, "RANK", "0"), _int(env, "WORLD_SIZE", "1"), _int(env, "LOCAL_RANK", "0"))
    if ranks.world_size < 1:
        raise RanksError(f"WORLD_SIZE={ranks.world_size} must be at least 1")
    if not 0 <= ranks.rank < ranks.world_size:
        raise RanksError(f"RANK={ranks.rank} is outside WORLD_SIZE={ranks.world_size}")
    if ranks.local_rank < 0:
        raise RanksError(f"LOCAL_RANK={ranks.local_rank} must not be negative")
    return ranks

"""The shared rank processes of the 2-rank tests (`tests.rank_pair`): results, failures, a replaced pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.rank_pair import RankPair


def _write(rank: int, out: Path, fail_on: int | None = None) -> None:
    if rank == fail_on:
        raise ValueError(f"rank {rank} fails on purpose")
    (out / f"rank-{rank}").write_text(f"{os.getpid()} {os.environ.get('RANK_PAIR_EARLIER', '-')}")


def _leave_environment(rank: int) -> None:
    os.environ["RANK_PAIR_EARLIER"] = "set by an earlier job"


def test_jobs_run_on_both_ranks_in_the_same_processes_with_a_clean_environment(tmp_path):
    pair = RankPair()
    try:
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir(), second.mkdir()
        pair.run(_write, first)
        pair.run(_leave_environment)
        pair.run(_write, second)
        pids = {rank: (first / f"rank-{rank}").read_text().split()[0] for rank in range(2)}
        assert len(set(pids.values())) == 2  # two processes ...
        for rank in range(2):  # ... that ran both jobs, the second without what the one before left in os.environ
            assert (second / f"rank-{rank}").read_text() == f"{pids[rank]} -"
    finally:
        pair.close()


def test_a_failing_rank_raises_with_its_traceback_and_the_pair_is_replaced(tmp_path):
    pair = RankPair()
    try:
        with pytest.raises(AssertionError, match=r"(?s)_write failed on rank 1 of 2.*ValueError: rank 1 fails on purpose"):
            pair.run(_write, tmp_path, 1)
        pair.run(_write, tmp_path)  # new processes answer
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-1"]
    finally:
        pair.close()

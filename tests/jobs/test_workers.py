"""The shared process pool: its workers never see a Ctrl-C meant for the job, not even while they start."""

from __future__ import annotations

import os
import signal

import pytest

from relicv2.jobs.workers import worker_pool
from relicv2.shards.verify import verify_shard  # the real one, before a test patches the module's


def _blocked_signals() -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_start_with_ctrl_c_blocked_and_the_job_keeps_it(start_method) -> None:
    """SIGINT is blocked in a worker from its first instruction (before its imports, where a Ctrl-C would
    print a KeyboardInterrupt traceback from it), and the job's own mask is as it was."""
    before = _blocked_signals()
    with worker_pool(2, start_method=start_method) as pool:
        blocked = [pool.submit(_blocked_signals).result() for _ in range(2)]
    assert all(signal.SIGINT in mask for mask in blocked)
    assert _blocked_signals() == before and signal.SIGINT not in before


def _dies_on_the_second_tar(tar, *args, **kwargs):  # in a forked worker, as the out-of-memory killer would
    if tar.name.endswith("000001.tar"):
        os.kill(os.getpid(), signal.SIGKILL)
    return verify_shard(tar, *args, **kwargs)


def test_a_worker_that_dies_in_any_job_is_one_line_saying_the_rerun_resumes(tmp_path, monkeypatch) -> None:
    """The command ends in one line and exit 1, not the pool's traceback (`relicv2` turns every pool's
    BrokenProcessPool into it)."""
    from click.testing import CliRunner

    from relicv2.cli.main import cli
    from relicv2.shards import verify as verify_module
    from relicv2.shards import write_shard_set
    from tests.saliency.network.conftest import scene_samples

    samples, _ = scene_samples(4)
    write_shard_set(samples, tmp_path / "set", max_count=2)
    monkeypatch.setattr(verify_module, "verify_shard", _dies_on_the_second_tar)
    result = CliRunner().invoke(cli, ["shards", "verify", str(tmp_path / "set"), "--workers", "2", "--no-progress",
                                      "--index-cache", str(tmp_path / "cache")])
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.output.strip().splitlines()[-1] == (
        "Error: a worker process died (killed by the system for memory? see dmesg); what it finished is kept: rerun "
        "the same command to resume")
    assert "Traceback" not in result.output and "concurrent.futures" not in result.output

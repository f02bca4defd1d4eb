"""A tar being written is dropped by `TarShard.abort` even when the disk is full (its last flush fails)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from relicv2.shards.sample import ShardSample
from relicv2.shards.writer import TarShard, sample_record
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
shard = TarShard(Path(sys.argv[1]) / "images-000000.tar")
shard.add_record(sample_record(ShardSample("a", {"jpg": b"x" * 6000}, None, {})))  # buffered: nothing reaches the disk yet
shard.abort()
print("aborted")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE stands in for a full disk")
def test_abort_on_a_full_disk_removes_the_partial_tar(tmp_path):
    job = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert job.returncode == 0 and job.stdout.strip() == "aborted", job.stderr
    assert list(tmp_path.iterdir()) == []

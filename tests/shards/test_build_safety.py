"""`shards build / merge / verify` on folders a user already has: own files only, locks, disks, links."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from relicv2 import shards
from relicv2.cli.demo import demo_data
from relicv2.cli.shards import shards_group
from relicv2.jobs.atomic import OutputError
from relicv2.jobs.lock import LOCK_NAME, acquire, release
from relicv2.jobs.ranks import Ranks
from relicv2.shards.build import BuildConfig, build_shards
from relicv2.shards.merge import plan_file
from relicv2.shards.sources import InputError
from tests.paths import REPO
from tests.shards.test_build import encoded, image


def folder(root: Path, count: int = 6, classes: tuple[str, ...] = ()) -> Path:
    for i in range(count):
        sub = root / classes[i % len(classes)] if classes else root
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"im{i:03d}.jpg").write_bytes(encoded(image(i, size=(40, 40)), "JPEG"))
    return root


def config(src: Path, out: Path, **kw) -> BuildConfig:
    return BuildConfig(input=src, out_dir=out, progress=False, min_side=16, workers=1, **kw)


def user_tars(out: Path, count: int = 3) -> dict[str, bytes]:
    """Tars a user made elsewhere under the default names, with the bytes to check them against."""
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    for i in range(count):
        name = f"images-{i:06d}.tar"
        (out / name).write_bytes(f"user data {i}".encode() * 100)
        made[name] = (out / name).read_bytes()
    return made


def test_build_refuses_a_folder_holding_a_users_tars_and_never_deletes_them(tmp_path):
    src, out = folder(tmp_path / "in"), tmp_path / "out"
    mine = user_tars(out, 10)
    for overwrite in (False, True):
        with pytest.raises(InputError, match="no build of this folder wrote|files no build wrote"):
            build_shards(config(src, out, max_count=2, overwrite=overwrite))
        assert {n: (out / n).read_bytes() for n in mine} == mine
    # other files are refused without --overwrite and left untouched with it
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "data-000000.tar").write_bytes(b"mine too")
    with pytest.raises(InputError, match=r"files no build wrote \(data-000000.tar, notes.txt\)"):
        build_shards(config(src, other))
    build_shards(config(src, other, overwrite=True))
    assert (other / "notes.txt").read_text() == "mine" and (other / "data-000000.tar").read_bytes() == b"mine too"
    assert shards.read_manifest(other).num_rows == 6


def test_overwrite_removes_only_the_previous_builds_files(tmp_path):
    src, out = folder(tmp_path / "in", 8), tmp_path / "out"
    build_shards(config(src, out, max_count=1))  # 8 shards
    (out / "keep.txt").write_text("user file")
    (out / "images-000099.tar").write_bytes(b"user tar")  # not in that build's plan
    with pytest.raises(InputError, match="other inputs or settings"):
        build_shards(config(src, out, max_count=4, overwrite=False))
    with pytest.raises(InputError, match="images-000099.tar"):  # would be overwritten by no build: refused
        build_shards(config(src, out, max_count=4, overwrite=True))
    (out / "images-000099.tar").unlink()
    build_shards(config(src, out, max_count=4, overwrite=True))
    assert sorted(p.name for p in out.glob("*.tar")) == ["images-000000.tar", "images-000001.tar"]
    assert (out / "keep.txt").read_text() == "user file"
    assert shards.verify_shard_set(out).ok


def test_write_shard_set_removes_only_its_previous_shards(tmp_path):
    samples = [shards.ShardSample(f"k{i}", {"jpg": encoded(image(i, size=(40, 40)), "JPEG")}) for i in range(6)]
    shards.write_shard_set(samples, tmp_path, max_count=1)
    (tmp_path / "images-000050.tar").write_bytes(b"user")
    shards.write_shard_set(samples, tmp_path, max_count=3)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["images-000000.tar", "images-000001.tar", "images-000050.tar"]
    assert not (tmp_path / "images-000005.idx").exists()


def test_corrupt_plan_is_refused_in_one_line_and_overwrite_gets_past_it(tmp_path):
    src, out = folder(tmp_path / "in"), tmp_path / "out"
    build_shards(config(src, out))
    plan_file(out).write_text("{not json")
    runner = CliRunner()
    args = ["build", str(src), str(out), "--min-side", "16", "--workers", "1", "--no-progress"]
    result = runner.invoke(shards_group, args)
    assert result.exit_code == 1 and "unreadable build plan" in result.output and "Traceback" not in result.output
    result = runner.invoke(shards_group, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert shards.verify_shard_set(out).ok
    plan_file(out).write_text("[1, 2]")
    result = runner.invoke(shards_group, ["merge", str(out)])
    assert result.exit_code == 1 and "not a readable build plan" in result.output


def test_second_job_on_a_folder_is_refused_and_rank_1_ignores_the_lock(tmp_path):
    src, out = folder(tmp_path / "in"), tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                 "started": time.time(), "job": "relicv2 shards build"}))
        result = CliRunner().invoke(shards_group, ["build", str(src), str(out), "--no-progress", "--workers", "1"])
        assert result.exit_code == 1 and f"pid {holder.pid}" in result.output and "in use" in result.output
        result = CliRunner().invoke(shards_group, ["merge", str(out)])
        assert result.exit_code == 1 and "in use" in result.output
        report = build_shards(config(src, out, merge_timeout_s=0), Ranks(1, 2))  # rank 1 writes beside rank 0
        assert report.merge is None and report.shards_built == 1
    finally:
        holder.kill()
        holder.wait()
    lock = acquire(out, "test")  # the dead holder's lock is taken over
    release(lock)


def test_stale_temporaries_are_removed_and_counted(tmp_path, capsys):
    src, out = folder(tmp_path / "in"), tmp_path / "out"
    out.mkdir()
    (out / ".images-000000.tar.tmp-host-999").write_bytes(b"partial")
    (out / ".info.json.tmp-host-998").write_bytes(b"partial")
    build_shards(config(src, out))
    assert "removed 2 stale temporary file(s)" in capsys.readouterr().err
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    src, out = folder(tmp_path / "in"), tmp_path / "out"

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp))

    monkeypatch.setattr(shards.writer.TarShard, "add_record", full)
    args = ["build", str(src), str(out), "--no-progress", "--workers", "1", "--min-side", "16"]
    result = CliRunner().invoke(shards_group, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "No space left on device" in result.output and "free space" in result.output
    assert not list(out.glob("*.tar")) and not [p for p in out.iterdir() if ".tmp-" in p.name]
    with pytest.raises(OutputError, match="No space left"):
        build_shards(config(src, out))
    monkeypatch.undo()
    build_shards(config(src, out))  # the rerun completes
    assert shards.verify_shard_set(out).ok


def test_output_paths_that_cannot_be_folders(tmp_path):
    src = folder(tmp_path / "in")
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(shards_group, ["build", str(src), str(tmp_path / "file"), "--no-progress"])
    assert result.exit_code == 1 and "existing file" in result.output
    result = CliRunner().invoke(shards_group, ["build", str(src), str(src), "--no-progress"])
    assert result.exit_code == 1 and "input folder itself" in result.output
    result = CliRunner().invoke(demo_data, [str(tmp_path / "file")])
    assert result.exit_code == 2 and "is a file" in result.output


def test_output_inside_input_is_left_out_and_reruns_work(tmp_path):
    src = folder(tmp_path / "in", 6, classes=("a", "b"))
    out = src / "shards"
    for _ in range(2):
        report = build_shards(config(src, out))
        assert report.merge.written == 6 and report.merge.rejected == 0
    info = json.loads((out / "info.json").read_text())
    assert info["classes"] == ["a", "b"]


def test_directory_link_loops_end_and_are_reported(tmp_path):
    src = folder(tmp_path / "in", 4)
    (src / "sub").mkdir()
    (src / "sub" / "loop").symlink_to(src, target_is_directory=True)
    (src / "again").symlink_to(src / "sub", target_is_directory=True)
    report = build_shards(config(src, tmp_path / "out", layout="flat"))
    assert report.merge.written == 4
    rejected = {r["source"]: r["reason"] for r in shards.read_rejected(tmp_path / "out").to_pylist()}
    assert set(rejected.values()) == {"folder_visited_twice"} and len(rejected) == 2


@pytest.mark.parametrize("args", [["shards", "build", "IN", "OUT", "--workers", "0"],
                                  ["shards", "verify", "OUT", "--workers", "-1"],
                                  ["demo", "OUT", "--size", "0"]])
def test_impossible_numbers_are_refused_up_front(tmp_path, args):
    group = shards_group if args[0] == "shards" else demo_data
    argv = [str(tmp_path / a) if a in ("IN", "OUT") else a for a in args[1:]]
    (tmp_path / "IN").mkdir()
    (tmp_path / "OUT").mkdir()
    result = CliRunner().invoke(group, argv)
    assert result.exit_code == 2 and "Invalid value" in result.output
    assert not list((tmp_path / "OUT").iterdir())


def test_workers_exit_when_the_job_is_killed(tmp_path):
    code = (
        "import os, time\n"
        "from relicv2.jobs.workers import worker_pool\n"
        "pool = worker_pool(2)\n"
        "print(pool.submit(os.getpid).result(), flush=True)\n"
        "time.sleep(60)\n"
    )
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = int(job.stdout.readline())
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{worker}/stat") as f:  # a zombie waiting for init to reap it is gone too
            if f.read().split(") ", 1)[1].startswith("Z"):
                return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived the killed job by 10 s")


def test_verify_reports_broken_set_files_in_one_line_each(tmp_path):
    samples = [shards.ShardSample(f"k{i}", {"jpg": encoded(image(i, size=(40, 40)), "JPEG")}) for i in range(4)]
    shards.write_shard_set(samples, tmp_path, max_count=2)
    (tmp_path / "info.json").write_text("{garbage")
    result = CliRunner().invoke(shards_group, ["verify", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 1 and "info.json: not valid JSON" in result.output and "Traceback" not in result.output
    assert "shards verify: 2/2 shard(s) in" in result.output  # one line per phase off a terminal
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": [1, 2]}), tmp_path / "manifest.parquet")
    result = CliRunner().invoke(shards_group, ["verify", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 1 and "not a relicv2 manifest" in result.output
    (tmp_path / "manifest.parquet").write_bytes(b"PAR1 garbage")
    result = CliRunner().invoke(shards_group, ["verify", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 1 and "manifest.parquet: cannot be read" in result.output


def test_verify_checks_plain_webdataset_sets(tmp_path):
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "train-%04d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(6):
            cls = b"1" if i < 3 else b"tench"  # class names (other tools write them) are not damage
            sink.write({"__key__": f"s{i}", "jpg": encoded(image(i, size=(40, 40)), "JPEG"), "cls": cls})
    runner = CliRunner()
    args = ["verify", str(tmp_path), "--workers", "2", "--index-cache", str(tmp_path / ".cache")]
    result = runner.invoke(shards_group, args)
    assert result.exit_code == 0 and "OK, 2 shards, 6 samples" in result.output, result.output
    data = (tmp_path / "train-0001.tar").read_bytes()
    (tmp_path / "train-0001.tar").write_bytes(data[:2000])
    result = runner.invoke(shards_group, args)
    assert result.exit_code == 1 and "train-0001.tar" in result.output


@pytest.mark.parametrize(("code", "hint"), [(errno.EROFS, "read-only"), (errno.EACCES, "may not write"),
                                            (errno.ENOSPC, "free space")])
def test_output_errors_name_path_cause_and_way_out(tmp_path, code, hint):
    from relicv2.shards.job import output_error

    message = str(output_error(OSError(code, os.strerror(code), str(tmp_path / "x.tar")), tmp_path))
    assert message.startswith(f"cannot write {tmp_path / 'x.tar'}: {os.strerror(code)}") and hint in message
    assert "\n" not in message


def test_ranks_come_from_torchrun_variables_once():
    from relicv2.jobs.ranks import RanksError, ranks_from_env

    assert ranks_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Ranks(3, 4, 1)
    assert ranks_from_env({}) == Ranks(0, 1, 0)
    for env, match in (({"RANK": "x"}, "RANK='x' is not an integer"), ({"RANK": "2", "WORLD_SIZE": "2"}, "outside"),
                       ({"WORLD_SIZE": "0"}, "at least 1"), ({"LOCAL_RANK": "-1"}, "negative")):
        with pytest.raises(RanksError, match=match):
            ranks_from_env(env)


def test_a_tampered_plan_cannot_make_overwrite_delete_outside_the_folder(tmp_path):
    src, out = folder(tmp_path / "in"), tmp_path / "out"
    build_shards(config(src, out))
    victim = tmp_path / "victim.tar"
    victim.write_bytes(b"precious")
    plan = json.loads(plan_file(out).read_text())
    plan["shards"].append({"name": "../victim.tar", "digest": "0" * 64, "images": 1})
    plan["digest"] = "tampered"
    plan_file(out).write_text(json.dumps(plan))
    with pytest.raises(InputError, match="unreadable build plan"):
        build_shards(config(src, out, seed=3))
    build_shards(config(src, out, seed=3, overwrite=True))
    assert victim.read_bytes() == b"precious"

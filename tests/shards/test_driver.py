"""The shard-job driver with a toy job: unit n writes one sample per line of its input file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relicv2.jobs.ranks import Ranks
from relicv2.shards import read_manifest
from relicv2.shards.driver import UnitOutput, run_shard_job
from relicv2.shards.job import ShardJob, UnfinishedError, Unit, merge_records, sha256_of, write_plan
from relicv2.shards.sample import ShardSample
from relicv2.shards.writer import TarShard, sample_record, shard_name


class LinesWork:
    """The toy job's own part: a unit's input is a text file, checked by its SHA-256."""

    def __init__(self, files: list[Path], out: Path):
        self.files, self.out, self.ran = files, out, []

    def claim(self, job: ShardJob, ranks: Ranks) -> None:
        write_plan(job, {"inputs": [f.name for f in self.files]})

    def inputs(self, number: int) -> dict:
        return {"sha256": sha256_of(self.files[number])}

    def items(self, number: int) -> int:
        return len(self.files[number].read_text().splitlines())

    def run(self, numbers, bar):
        for number in numbers:
            self.ran.append(number)
            tar = TarShard(self.out / shard_name("lines", number))
            for i, line in enumerate(self.files[number].read_text().splitlines()):
                tar.add_record(sample_record(ShardSample(f"u{number}_{i}", {"txt": line.encode()})))
                bar.update(1)
            tar.close()
            yield UnitOutput(tar, [])

    def merge(self, job: ShardJob, records: list[dict]):
        return merge_records(job.out, records, info={"job": "lines"})


def toy_job(tmp_path: Path, units: int = 4) -> tuple[ShardJob, LinesWork]:
    """Unit n's input holds n + 1 lines (written once: a later call finds the files as they are)."""
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir(exist_ok=True)
    files = [folder / f"unit-{n}.txt" for n in range(units)]
    for n, file in enumerate(files):
        if not file.exists():
            file.write_text("".join(f"line {n}.{i}\n" for i in range(n + 1)))
    units = tuple(Unit(f"{n:06d}", shard_name("lines", n), f"digest-{n}") for n in range(units))
    return ShardJob(out, out / ".toy", units), LinesWork(files, out)


def run(job: ShardJob, work: LinesWork, ranks: Ranks = Ranks()):
    return run_shard_job(job, work, ranks, name="toy", progress=False, merge_timeout_s=0)


def test_ranks_take_disjoint_units_and_rank_0_merges_one_manifest(tmp_path):
    job, second = toy_job(tmp_path)
    report = run(job, second, Ranks(1, 2))
    assert second.ran == [2, 3] and report.merge is None and report.records is None
    job, first = toy_job(tmp_path)
    report = run(job, first, Ranks(0, 2))
    assert first.ran == [0, 1] and report.written == 1 + 2 and report.kept_elsewhere == 2
    assert report.merge.shards == 4 and report.merge.written == 1 + 2 + 3 + 4
    keys = read_manifest(job.out).column("key").to_pylist()
    assert keys == [f"u{n}_{i}" for n in range(4) for i in range(n + 1)]
    assert json.loads((job.out / "info.json").read_text())["job"] == "lines"


def test_the_merging_rank_names_the_units_still_missing(tmp_path):
    job, work = toy_job(tmp_path)
    with pytest.raises(UnfinishedError, match=r"2 shard\(s\) .*lines-000002.tar, lines-000003.tar.*way out"):
        run_shard_job(job, work, Ranks(0, 2), name="toy", progress=False, merge_timeout_s=0, rerun="way out")
    assert work.ran == [0, 1] and not (job.out / "manifest.parquet").exists()


def test_a_rerun_skips_finished_units_and_redoes_one_whose_input_changed(tmp_path):
    job, work = toy_job(tmp_path)
    run(job, work)
    assert work.ran == [0, 1, 2, 3]
    job, work = toy_job(tmp_path)
    report = run(job, work)
    assert work.ran == [] and report.shards_built == 0 and report.shards_kept == 4 and report.merge.written == 10
    (tmp_path / "in" / "unit-2.txt").write_text("changed\n")
    job, work = toy_job(tmp_path)
    report = run(job, work)
    assert work.ran == [2] and report.repaired == ("lines-000002.tar",) and report.shards_kept == 3
    assert "u2_0" in read_manifest(job.out).column("key").to_pylist()
    assert report.merge.written == 1 + 2 + 1 + 4


def test_a_lost_tar_is_redone_and_a_killed_runs_temporaries_go(tmp_path):
    job, work = toy_job(tmp_path)
    run(job, work)
    (job.out / "lines-000001.tar").unlink()
    (job.out / ".lines-000003.tar.tmp-host-1").write_bytes(b"partial")
    job, work = toy_job(tmp_path)
    report = run(job, work)
    assert work.ran == [1] and report.repaired == ("lines-000001.tar",)
    assert not [p for p in job.out.iterdir() if ".tmp-" in p.name]

"""The shard-job engine's driver: the one sequence (lock, claim, this rank's units, progress, done records,
wait, merge) of every job that writes a shard set. A job brings its planned units (`shards.job.ShardJob`)
and its own part (`UnitWork`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from relicv2.jobs.atomic import remove_stale_temps
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase, tracked
from relicv2.jobs.ranks import Ranks
from relicv2.jobs.workers import worker_died
from relicv2.shards.index import shard_files
from relicv2.shards.job import (
    NOT_DONE,
    MergeReport,
    ShardJob,
    UnfinishedError,
    input_tar_identity,
    output_error,
    pending_reason,
    rank_units,
    wait_for_records,
    write_plan,
    write_record,
)
from relicv2.shards.outdir import output_folder
from relicv2.shards.writer import TarShard


class UnitOutput(NamedTuple):
    """What one unit wrote: its closed tar (None: no sample could be written), its rejected-list rows, and
    what else the job keeps in the unit's done record for its summary."""

    shard: TarShard | None
    rejected: list[dict]
    extra: dict | None = None


class UnitWork(Protocol):
    """A shard job's own part, which `run_shard_job` drives."""

    def claim(self, job: ShardJob, ranks: Ranks) -> None:
        """Check the output folder and write the job's plan (`shards.job.write_plan`): under the folder's
        lock, before any other output."""

    def inputs(self, number: int) -> dict | None:
        """What the rank doing unit `number` checks of its inputs besides the unit's digest (None: nothing)."""

    def items(self, number: int) -> int:
        """The items (images) of unit `number`: the progress bar counts them."""

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        """Do the units `numbers` in order, counting every item on `bar`; yield each one's output once its
        tar is closed."""

    def merge(self, job: ShardJob, records: list[dict]) -> MergeReport:
        """Write the set's manifest, rejected list and info.json from every unit's done record (as
        `wait_for_records` gives them), with `shards.job.merge_records`."""


class TarUnits:
    """`claim`, `inputs` and `items` of a job whose unit is one input tar of a shard set (`self.source`, a
    `ShardSet`) and whose plan is `self.plan`: the part every such `UnitWork` shares."""

    def claim(self, job: ShardJob, ranks: Ranks) -> None:
        write_plan(job, self.plan)

    def inputs(self, number: int) -> dict:
        return input_tar_identity(self.source.tars[number], self.source.index_files[number])

    def items(self, number: int) -> int:
        return self.source.counts[number]


@dataclass(frozen=True)
class JobReport:
    """What one rank of a shard job did, and (rank 0) the merged set."""

    shards_built: int  # this rank's units done by this run
    shards_kept: int  # this rank's units an earlier run finished, left as they are
    written: int  # samples this rank wrote
    rejected: int  # samples this rank rejected
    merge: MergeReport | None  # rank 0's
    repaired: tuple[str, ...]  # the tars of the units built that an earlier run finished, changed since
    kept_elsewhere: int  # the other ranks' units with a done record when this rank began
    items: int  # items counted on the progress bar
    seconds: float  # this rank's units
    records: list[dict] | None = None  # rank 0's: every unit's done record
    seconds_to_merge: float | None = None  # rank 0's: from its first unit until every record was there


REHASH_OPTION = "--rehash-shards"  # the commands' option for `run_shard_job(rehash=True)`


def run_shard_job(job: ShardJob, work: UnitWork, ranks: Ranks, *, name: str, progress: bool = True,
                  merge_timeout_s: float = 3600.0, rerun: str = "rerun the same command on every rank",
                  rehash: bool = False) -> JobReport:
    """Run (or resume) this rank's units of `job`, then (rank 0) wait up to `merge_timeout_s` for the other
    ranks' units and merge. `name` is the command (`shards build`): the lock's holder and the progress bar
    say it. With `rehash` every finished unit's tar is hashed against its record and redone when it
    differs (bit rot); without, no finished tar is read. Raises OutputError when the output cannot be
    written, UnfinishedError (with `rerun`, the way out) when units stay unfinished or a worker process
    died, and what the job's own part raises."""
    try:
        # The lock is released (its file removed) before an empty folder is removed.
        with output_folder(job.out), folder_lock(job.out, f"relicv2 {name}", enabled=ranks.rank == 0):
            work.claim(job, ranks)
            mine = rank_units(len(job.units), ranks.rank, ranks.world_size)
            inputs, reasons = {}, {}
            for n in tracked(mine, f"{name}: checking done records", len(mine), unit="shard", enabled=progress):
                inputs[n] = work.inputs(n)
                reasons[n] = pending_reason(job, job.units[n], inputs[n], rehash)
            todo = [n for n in mine if reasons[n] is not None]
            repaired = {job.units[n].shard: reasons[n] for n in todo if reasons[n] != NOT_DONE}
            for shard, reason in repaired.items():
                print(f"rebuilding {shard}, finished by an earlier run: {reason}", file=sys.stderr)
            # The other ranks' units with a record now were finished by an earlier run (a record one of
            # them writes in the moments since it began counts as kept: a report, not a decision).
            kept_elsewhere = sum(n not in mine and job.record_path(u).is_file() for n, u in enumerate(job.units))
            if ranks.world_size == 1:  # alone in the folder (we hold its lock): every temporary is stale
                stale = remove_stale_temps(job.out) + remove_stale_temps(job.work)
            else:  # other ranks write beside us: only our own units' temporaries
                stale = remove_stale_temps(job.out, shard_files([job.units[n].shard for n in todo]))
            if stale:
                print(f"removed {stale} stale temporary file(s) left by an interrupted run in {job.out}",
                      file=sys.stderr)
            total, written, rejected = sum(work.items(n) for n in todo), 0, 0
            started = time.monotonic()
            label = name if ranks.world_size == 1 else f"{name}, rank {ranks.rank}/{ranks.world_size}"
            done = 0
            try:
                with Phase(label, total, unit="img", enabled=progress and bool(todo)) as bar, \
                        contextlib.closing(work.run(todo, bar)) as outputs:  # closed now: a pool in it shuts down now
                    for n, output in zip(todo, outputs, strict=True):
                        record = write_record(job, job.units[n], output.shard, output.rejected, inputs=inputs[n],
                                              extra=output.extra)
                        written, rejected = written + len(record["manifest"]), rejected + len(record["rejected"])
                        done += 1
            except BrokenProcessPool as exc:
                raise UnfinishedError(worker_died(f"{name} made {job.out / job.units[todo[done]].shard}",
                                                  "finished shards are kept")) from exc
            report = JobReport(len(todo), len(mine) - len(todo), written, rejected, None, tuple(repaired), kept_elsewhere,
                               bar.count, time.monotonic() - started)
            if ranks.rank != 0:
                return report
            records = wait_for_records(job, merge_timeout_s if ranks.world_size > 1 else 0, progress=progress,
                                       rerun=rerun)
            until_merge = time.monotonic() - started
            return dataclasses.replace(report, merge=work.merge(job, records), records=records,
                                       seconds_to_merge=until_merge)
    except OSError as exc:
        raise output_error(exc, job.out) from exc

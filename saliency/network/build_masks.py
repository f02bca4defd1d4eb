"""`relicv2 saliency build-masks`: a masked shard set from a shard set and a trained saliency model.

Input: any shard set `shards.shardset.resolve_shard_set` takes; indexes missing beside its tars are
derived once into the index cache (`--index-cache`); nothing is written beside the input.

Output `OUT/masked-NNNNNN.tar` (+ `.idx`), one per input shard, each sample holding the input's image
bytes unchanged (`output_member` names it), its `.cls`, its json plus `mask_coverage` / `mask_status`,
and `{key}.mask.png`: the 8-bit soft mask at the displayed image's size (EXIF orientation applied, as
DALI's decoder applies it). Then `manifest.parquet`, `rejected.parquet`, `info.json` and `config.yaml`.

- Streaming: decoding, the network and mask encoding overlap on a shared-memory ring of batches
  (`mask_shard.mask_shard`, `mask_work.SlotRing`); memory is a few batches whatever the data set size.
- Resumable and multi-node: the shard-job engine (`shards.driver`) runs one unit per input shard, its done
  record in `OUT/.build-masks/` (`masks_job` says what its digest covers). Batches never span input shards
  and inference is deterministic, so a resumed result is byte-identical to an uninterrupted run.
- Refusals: an --out holding files this job did not write (a user's, another tool's) is refused,
  naming them, before anything is written; so are a --device this machine lacks and a model without a
  usable input size. A refused job leaves no --out; an unwritable one is one line naming the path.

Settings: `config.BuildMasksConfig`.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relicv2.jobs.atomic import OutputError, atomic_write_bytes
from relicv2.jobs.config import SETTINGS_FILE, ConfigError, settings_text
from relicv2.jobs.device import resolve_device
from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks, ranks_from_env
from relicv2.jobs.version import package_version
from relicv2.jobs.workers import local_ranks
from relicv2.saliency.network.config import BuildMasksConfig, CrfConfig, MasksError, job_workers
from relicv2.saliency.network.crf import model_crf
from relicv2.saliency.network.mask_shard import (
    MainThreadClock,
    input_index,
    mask_shard,
    mask_workers,
)
from relicv2.saliency.network.mask_work import RingSpaceError, check_shm_space, ring_bytes
from relicv2.saliency.network.model_file import PASS_MODEL, resolve_model_path
from relicv2.saliency.network.predictor import MaskPredictor
from relicv2.shards.driver import JobReport, TarUnits, UnitOutput, run_shard_job
from relicv2.shards.index import read_index
from relicv2.shards.job import (
    MergeReport,
    PlanError,
    ShardJob,
    UnfinishedError,
    check_plan,
    input_tar_identity,
    merge_records,
    rank_units,
    sha256_of,
    tar_job,
)
from relicv2.shards.manifest import MANIFEST_NAME, REJECTED_NAME
from relicv2.shards.outdir import SET_FILES, other_entries, shard_files
from relicv2.shards.sample import MASK_MEMBER, MIN_MASK_COVERAGE
from relicv2.shards.shardset import check_count, default_index_cache, listed_shards, shard_tars

PREFIX = "masked"
STATE_DIR = ".build-masks"


def _input_tars(config: BuildMasksConfig, ranks: Ranks) -> list[Path]:
    """The input set's tars in order. A set with a manifest: the tars it lists, this rank's checked
    against it (their index files lie beside them); each rank checks its own, so that no rank reads
    every index (a second an index on every rank at ImageNet's size). Plain sets are not indexed here
    (see `MaskWork.index_file`)."""
    tars, directory = shard_tars(config.shards)
    if directory is None or not (directory / MANIFEST_NAME).is_file():
        return tars
    listed, _ = listed_shards(directory)
    tars = list(listed)
    cache = default_index_cache(config.index_cache)
    for number in rank_units(len(tars), ranks.rank, ranks.world_size):
        tar = tars[number]
        check_count(tar, len(read_index(input_index(tar, cache), tar)), listed[tar])
    return tars


def check_input(tars: list[Path], out: Path) -> None:
    """Refuse an input that names a tar twice (its samples would be written twice) or lies in `out`
    (the masked tars, `masked-NNNNNN.tar`, would join the input set)."""
    resolved = [t.resolve() for t in tars]
    twice = [tar for tar, n in Counter(resolved).items() if n > 1]
    if twice:
        raise MasksError(f"the input names {twice[0]} more than once; give each shard once")
    out_dir = out.resolve()
    if any(t.parent == out_dir for t in resolved):
        raise MasksError(f"--out {out} holds input shards; choose an output folder apart from --shards")


def masks_job(out: Path, model_sha256: str, tars: list[Path], flip: bool, crf: bool) -> tuple[ShardJob, dict]:
    """The engine's job (`tar_job`: `masked-NNNNNN.tar` in the input's order, each unit's digest over the
    model and `flip` and `crf`, which make other masks) and its plan."""
    # Each option only when on: a job without them keeps the plan it had before they existed.
    masks = {"model_sha256": model_sha256, **({"flip": True} if flip else {}), **({"crf": True} if crf else {})}
    plan = {**masks, "input_shards": [t.name for t in tars], "prefix": PREFIX}
    return tar_job(out, STATE_DIR, tars, PREFIX, masks), plan


def check_out_folder(job: ShardJob) -> None:
    """Refuse an --out folder holding files this job did not write: anything, when no build-masks run
    began there (its plan); otherwise anything but its shards and set files. Like `shards build`, a
    job never overwrites, nor writes among, a user's own files."""
    out = job.out
    if out.exists() and not out.is_dir():
        raise MasksError(f"--out {out} is a file; choose an empty or new folder")
    ours = shard_files([unit.shard for unit in job.units]) | {*SET_FILES, SETTINGS_FILE}
    # Listed before the plan is looked at: under torchrun, rank 0 writes the plan before any output,
    # so an output seen here always comes with the plan that makes it ours.
    visible = other_entries(out, set())
    others = [name for name in visible if name not in ours] if job.plan_path.is_file() else visible
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise MasksError(f"--out {out} holds files this job did not write ({shown}); choose an empty or new folder")


@dataclass
class MaskWork(TarUnits):
    """build-masks' part of the shard-job engine (`shards.driver.UnitWork`): a unit is one input tar. Its
    `claim` (the plan, the first write: an unwritable --out is found before any work) is `TarUnits`'; its
    inputs and items come from `index_file`, not from a resolved set."""

    config: BuildMasksConfig
    job: ShardJob
    plan: dict
    tars: list[Path]
    predictor: Any
    workers: int
    crf: CrfConfig | None
    clock: MainThreadClock = field(default_factory=MainThreadClock)
    page_locked: bool = False  # the ring, for the predictor's DMA
    # Only the tars this rank reads are indexed: a plain set's missing index is derived by the one rank
    # that masks the tar, not by every rank of the job.
    index_files: dict[int, Path] = field(default_factory=dict)

    def index_file(self, number: int) -> Path:
        if number not in self.index_files:
            self.index_files[number] = input_index(self.tars[number], default_index_cache(self.config.index_cache))
        return self.index_files[number]

    def inputs(self, number: int) -> dict:
        return input_tar_identity(self.tars[number], self.index_file(number))

    def items(self, number: int) -> int:
        return len(read_index(self.index_file(number), self.tars[number]))

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        self.clock = MainThreadClock()  # from here: the first batch's time includes the workers' start
        with mask_workers(self.workers, self.config.batch_size, self.predictor, self.job.out) as (pool, ring):
            self.page_locked = ring.page_locked
            for number in numbers:
                tar, out_tar = self.tars[number], self.job.out / self.job.units[number].shard
                try:  # a worker that dies (BrokenProcessPool) is the engine's to report
                    output = mask_shard(tar, out_tar, self.predictor, pool, ring, bar, self.workers, self.clock,
                                        self.crf)
                except OSError as error:
                    if error.filename is None:  # a write to the tar (a full disk) names no file: name it
                        error.filename = str(out_tar)
                    raise
                yield output

    def merge(self, job: ShardJob, records: list[dict]) -> MergeReport:
        atomic_write_bytes(job.out / SETTINGS_FILE, settings_text(self.config, version=package_version()).encode())
        info = {"prefix": PREFIX, "source": str(self.config.shards), "model": self.plan["model_sha256"],
                "flip": self.config.flip, "crf": self.config.crf, "mask": mask_stats(coverage_of(records)),
                "version": package_version()}
        return merge_records(job.out, records, info=info)


def build_masks(config: BuildMasksConfig, ranks: Ranks | None = None, predictor=None) -> dict | None:
    """Run (or resume) the job; rank 0 returns the summary, the other ranks None. `predictor` (tests,
    benchmarks) stands in for the model file's network (see `launch_forward`); the file is still read."""
    ranks = ranks or ranks_from_env()
    tars = _input_tars(config, ranks)
    out = Path(config.out)
    check_input(tars, out)
    model = resolve_model_path(config.model)
    job, plan = masks_job(out, sha256_of(model), tars, config.flip, config.crf)
    try:  # the refusals, each before --out exists: a refused job leaves no folder behind
        check_plan(job, plan, other="a masked set built from another model, input, flip or crf setting")
        check_out_folder(job)
        device = resolve_device(config.device, "--device")
        if predictor is None:
            predictor = MaskPredictor(model, device, flip=config.flip)
            print(f"saliency build-masks: rank {ranks.rank} predicts on {device}", file=sys.stderr,
                  flush=True)
        try:
            crf = model_crf(predictor.info, str(model)) if config.crf else None
        except ConfigError as error:
            raise MasksError(f"{error}; {PASS_MODEL}") from None
        workers, workers_note = job_workers(config)
        # The ring itself is made with the workers; every rank of the node has one.
        check_shm_space(ring_bytes(config.batch_size, predictor.size) * local_ranks())
    except (PlanError, ConfigError, RingSpaceError) as error:
        raise MasksError(str(error)) from None
    if ranks.rank == 0:  # after the refusals: a refused job says one line
        print(settings_text(config, version=package_version()).rstrip(), file=sys.stderr, flush=True)
    work = MaskWork(config, job, plan, tars, predictor, workers, crf)
    try:
        report = run_shard_job(job, work, ranks, name="saliency build-masks", progress=config.progress,
                               merge_timeout_s=config.merge_timeout_s, rehash=config.rehash_shards)
    except (OutputError, UnfinishedError) as error:
        raise MasksError(str(error)) from None
    return None if report.records is None else summary_of(report, work, len(tars), workers_note)


def coverage_of(records: list[dict]) -> np.ndarray:
    """Every written mask's coverage (fraction >= 0.5), from the units' done records."""
    return np.concatenate([np.zeros(0), *(rec["manifest"].column("mask_coverage").to_numpy(zero_copy_only=False)
                                          for rec in records if rec["manifest"].num_rows)]).astype(np.float64)


def mask_stats(coverage: np.ndarray) -> dict:
    """info.json's `mask`: the masks below the minimum coverage pretraining applies, and a histogram."""
    return {"below_min_coverage": int((coverage < MIN_MASK_COVERAGE).sum()), "min_coverage": MIN_MASK_COVERAGE,
            "coverage_histogram": np.histogram(coverage, bins=10, range=(0.0, 1.0))[0].tolist()}


def summary_of(report: JobReport, work: MaskWork, shards: int, workers_note: str | None) -> dict:
    """Rank 0's summary of the merged job of `shards` units (`report.records`: every unit's done record)."""
    records = report.records or []
    coverage = coverage_of(records)
    members = sum((Counter(rec.get("members", {})) for rec in records), Counter())
    replaced = members.pop(MASK_MEMBER, 0)
    kept = report.shards_kept + report.kept_elsewhere
    return {
        "written": len(coverage),
        "rejected": sum(len(rec["rejected"]) for rec in records),
        "carried_members": dict(members),  # input members no job reads, written unchanged
        "replaced_masks": replaced,
        **mask_stats(coverage),
        "mean_coverage": float(coverage.mean()) if len(coverage) else None,
        "seconds": round(report.seconds_to_merge or 0.0, 2),
        "shards_kept": kept, "shards_built": shards - kept,
        "rejected_file": str(work.job.out / REJECTED_NAME), "workers": work.workers,
        "workers_note": workers_note, "ring_page_locked": work.page_locked,
        "images_per_s": round(report.items / report.seconds, 2) if report.items and report.seconds > 0 else None,
        **work.clock.report(),  # the clock: this rank's
    }


def format_summary(summary: dict) -> str:
    """A human summary: counts, shards kept and built, coverage histogram, the masks below the minimum
    coverage, and where the rejected samples are listed."""
    bars = "  ".join(f"{i * 10}-{i * 10 + 10}%: {n}" for i, n in enumerate(summary["coverage_histogram"]))
    rate = f" ({summary['images_per_s']} img/s this run)" if summary.get("images_per_s") is not None else ""
    lines = [
        f"build-masks: {summary['written']} masked, {summary['rejected']} rejected",
        f"{summary['shards_kept']} shard(s) kept from an earlier run, {summary['shards_built']} built{rate}"
        f" with {summary['workers']} worker process(es)",
        f"coverage (fraction >= 0.5): {bars}",
        f"{summary['below_min_coverage']} masks cover less than {summary['min_coverage']:.0%} and will not be "
        "applied in pretraining",
    ]
    if summary.get("workers_note"):
        lines.append(summary["workers_note"])
    if summary["carried_members"]:
        lines.append(f"input members no job reads, carried into the output unchanged: {summary['carried_members']}")
    if summary["replaced_masks"]:
        lines.append(f"{summary['replaced_masks']} input mask.png replaced by the new mask")
    if summary["rejected"]:
        lines.append(f"why each sample was rejected: {summary['rejected_file']}")
    return "\n".join(lines)

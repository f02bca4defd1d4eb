"""`relicv2 shards build | verify | index | merge | subset`."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import click

from relicv2.cli.options import index_cache_option, user_errors
from relicv2.jobs.atomic import OutputError
from relicv2.jobs.config import settings_text
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.ranks import RanksError, ranks_from_env
from relicv2.jobs.version import package_version
from relicv2.jobs.workers import usable_cores
from relicv2.shards.build import BuildConfig, build_shards
from relicv2.shards.driver import REHASH_OPTION
from relicv2.shards.job import INPUT_CHECKS, output_error
from relicv2.shards.limits import DEFAULT_MAX_PIXELS
from relicv2.shards.manifest import REJECTED_NAME
from relicv2.shards.merge import merge_shard_set, rejected_listing_command
from relicv2.shards.sources import LAYOUTS, InputError
from relicv2.shards.verify import verify_shard_set

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'1G', '500M', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise click.BadParameter(f"{text!r} is not a size; write e.g. 1G, 500M or 1048576")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


@click.group()
def shards_group() -> None:
    """Build, verify, index and subset WebDataset shard sets (and merge a multi-rank build)."""


@shards_group.command("build")
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.argument("out_arg", metavar="OUT", required=False, type=click.Path(path_type=Path))
@click.option("--out", "out_opt", type=click.Path(path_type=Path), help="Output folder (instead of the OUT argument).")
@click.option("--prefix", default="images", show_default=True, help="Shard names: PREFIX-000000.tar ...")
@click.option("--seed", default=0, show_default=True, help="Seed of the shuffle across shards.")
@click.option("--max-bytes", default="1G", show_default=True, help="Target shard size (e.g. 1G, 200M).")
@click.option("--max-count", type=int, default=None, help="Also cap each shard at this many samples.")
@click.option("--min-side", default=32, show_default=True, help="Reject images whose shorter side is below this.")
@click.option("--quality", default=95, show_default=True, help="JPEG quality for converted (non-JPEG/non-RGB) images.")
@click.option("--layout", type=click.Choice(LAYOUTS), default="auto", show_default=True,
              help="Folder input: classes = one sub-folder per class; flat = unlabeled (recursive); auto = classes when sub-folders exist.")
@click.option("--workers", type=click.IntRange(min=1), default=usable_cores(), show_default=True,
              help="Decoding processes (at least 1).")
@click.option("--max-pixels", type=click.IntRange(min=1), default=DEFAULT_MAX_PIXELS, show_default=True,
              help="Refuse images with more pixels than this (checked from the header, before decoding).")
@click.option("--input-check", type=click.Choice(INPUT_CHECKS), default="time", show_default=True,
              help="How a rerun tells an edited input image: time = its size and modification time (ns); "
                   "content = the SHA-256 of every input (reads them all; where file times cannot be trusted).")
@click.option(REHASH_OPTION, "rehash_shards", is_flag=True,
              help="Hash every finished shard and rebuild those whose bytes changed since they were written "
                   "(bit rot, as `shards verify` reports it); a plain rerun reads no finished shard.")
@click.option("--overwrite", is_flag=True,
              help="Replace a previous build in --out (only its own files are removed) or build beside other files.")
@click.option("--merge-timeout", default=3600.0, show_default=True, help="Under torchrun: seconds rank 0 waits for the other ranks before merging.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def build(input_path: Path, out_arg: Path | None, out_opt: Path | None, max_bytes: str, merge_timeout: float,
          **options) -> None:
    """Build shuffled, decode-verified WebDataset shards in OUT from INPUT: an image folder (one
    sub-folder per class, or flat = unlabeled) or a CSV/parquet file list (`path`, optional `label`
    or `class`).

    Rerun the same command after an interruption to resume. Under torchrun each rank builds its
    own shard range and rank 0 merges the manifests.
    """
    if (out_arg is None) == (out_opt is None):
        raise click.UsageError("give the output folder once: as OUT or as --out")
    out_dir = out_arg or out_opt
    command = (shlex.join(["relicv2", "shards", "build", *sys.argv[sys.argv.index("build") + 1 :]])
               if "build" in sys.argv else "")
    config = BuildConfig(input=input_path, out_dir=out_dir, max_bytes=parse_size(max_bytes),
                         merge_timeout_s=merge_timeout, command=command, **options)
    with user_errors(InputError, RanksError, OutputError, FileNotFoundError, RuntimeError):
        ranks = ranks_from_env()
        click.echo(settings_text(config, version=package_version()).rstrip(), err=True)
        report = build_shards(config, ranks)
    repaired = f" ({len(report.repaired)} of them finished by an earlier run, changed since: rebuilt)" if report.repaired else ""
    click.echo(
        f"rank {ranks.rank}/{ranks.world_size}: {report.shards_built} shard(s) built{repaired}, {report.shards_kept} "
        f"kept from an earlier run, {report.written} images written, {report.rejected} rejected while decoding"
    )
    if report.merge is not None:
        echo_merge(out_dir, report.merge)


def echo_merge(out_dir: Path, merge) -> None:
    reasons = ", ".join(f"{k} {v}" for k, v in merge.rejected_by_reason.items()) or "none"
    click.echo(f"{out_dir}: {merge.shards} shards, {merge.written} samples, {merge.rejected} rejected ({reasons})")
    if merge.empty_shards:
        click.echo(f"note: every input of {', '.join(merge.empty_shards)} was rejected; no file was written for it")
    if merge.rejected:
        rejected = out_dir / REJECTED_NAME
        click.echo(f"each rejected file and why: {rejected}; list them with: {rejected_listing_command(rejected)}")


@shards_group.command("merge")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--wait", default=0.0, show_default=True, help="Seconds to wait for unfinished shards.")
def merge(directory: Path, wait: float) -> None:
    """Merge the per-shard records of a (multi-rank) build into manifest.parquet, rejected.parquet, info.json."""
    if not directory.is_dir():
        raise click.ClickException(f"{directory} is not a folder; give the output folder of a shard build")
    try:
        with user_errors(FileNotFoundError, RuntimeError), folder_lock(directory, "relicv2 shards merge"):
            report = merge_shard_set(directory, wait_s=wait)
    except OSError as exc:  # other than a missing file: one that cannot be written
        raise click.ClickException(str(output_error(exc, directory))) from None
    echo_merge(directory, report)


@shards_group.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--workers", type=click.IntRange(min=1), default=usable_cores(), show_default=True,
              help="Processes checking shards (at least 1).")
@click.option("--decode/--no-decode", default=True, show_default=True, help="Fully decode every image.")
@index_cache_option
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress.")
def verify(directory: Path, workers: int, decode: bool, index_cache: Path | None, progress: bool) -> None:
    """Check every shard of DIRECTORY: against the manifest when the set has one (counts, keys,
    hashes, decodability, index files), else (plain WebDataset shards) that every tar reads, every
    sample has a decodable image and a valid label, and the index agrees with the tar."""
    if not directory.is_dir():
        raise click.ClickException(f"{directory} is not a folder; give the shard set's folder")
    with user_errors(FileNotFoundError, ValueError):
        report = verify_shard_set(directory, workers=workers, decode_images=decode,
                                  index_cache=index_cache, progress=progress)
    for problem in report.problems:
        click.echo(problem)
    if not report.ok:
        repair = f"; {report.repair}" if report.repair else ""
        raise click.ClickException(
            f"{len(report.problems)} problem(s) in {directory} ({report.shards} shards, {report.samples} samples)"
            + repair
        )
    click.echo(f"{directory}: OK, {report.shards} shards, {report.samples} samples verified")


@shards_group.command("index")
@click.argument("spec", metavar="SHARDS")
@index_cache_option
@click.option("--workers", type=click.IntRange(min=1), default=usable_cores(), show_default=True,
              help="Processes reading tars at once.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress.")
def index(spec: str, index_cache: Path | None, workers: int, progress: bool) -> None:
    """Derive the DALI index files of a shard set and check its samples once, before the jobs that read it.

    SHARDS: a folder of plain tars, a brace pattern ('/data/wds/train-{0000..1023}.tar'), a tar,
    or a folder from `relicv2 shards build`. Each tar without an index beside it is read once and
    its index written into the cache (`--index-cache`, else $RELICV2_INDEX_CACHE, else
    ~/.cache/relicv2/index); then every sample gets the check the view loaders run when they open a
    set (members, image signatures, and for sets without a manifest the picture size from its
    header), and the verdicts are kept in the same cache. Tars done before are skipped. Point every
    job at the same cache (a shared folder on a cluster): no rank then reads the set at start.
    """
    from relicv2.shards.checks import CHECKS_FOLDER, check_shard_set
    from relicv2.shards.shardset import ShardSetError, default_index_cache, derive_missing_indexes

    cache = default_index_cache(index_cache)
    try:
        with user_errors(ShardSetError):
            derived = derive_missing_indexes(spec, index_cache=cache, workers=workers, progress=progress)
    except OSError as exc:
        raise click.ClickException(f"cannot write index files into {cache} ({exc.strerror or exc}); "
                                   "choose a writable --index-cache") from None
    for reason in derived.failed.values():
        click.echo(reason, err=True)
    click.echo(f"{spec}: {derived.written} index file(s) derived into {cache}, "
               f"{derived.tars - derived.written - len(derived.failed)} already there or beside their tar, "
               f"{len(derived.failed)} unreadable ({derived.tars} tars)")
    if derived.failed:
        raise click.ClickException(f"{len(derived.failed)} tar(s) could not be indexed (listed above); "
                                   "rebuild or remove them")
    with user_errors(ValueError):  # a hostile or inconsistent index: one line naming the file and the fix
        check = check_shard_set(spec, index_cache=cache, workers=workers, progress=progress)
    left_out = ", ".join(f"{n} {reason}" for reason, n in sorted(check.left_out.items())) or "none"
    click.echo(f"{spec}: samples of {check.fresh} tar(s) checked, {check.tars - check.fresh} checked before; "
               f"the loaders will leave out {sum(check.left_out.values())} sample(s) ({left_out})")
    if check.unstored:
        raise click.ClickException(f"cannot keep the sample checks in {cache / CHECKS_FOLDER}; "
                                   "choose a writable --index-cache")


@shards_group.command("subset")
@click.argument("shards_dir", metavar="SHARDS")
@click.option("--fraction", type=float, required=True, help="Share of every class to keep, e.g. 0.01 or 0.1.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Key list to write (one key a line).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--min-per-class", type=click.IntRange(min=1), default=1, show_default=True)
@index_cache_option
def subset(shards_dir: str, fraction: float, out: Path, seed: int, min_per_class: int, index_cache: Path | None) -> None:
    """Write FRACTION of every class's keys of a labelled shard set, drawn with SEED.

    SHARDS: a `relicv2 shards build` folder, or plain WebDataset tars (folder, brace pattern or tar)
    whose `cls` members hold class indices.

    \b
    relicv2 shards subset shards/train --fraction 0.01 --out splits/1pct.txt
    relicv2 eval finetune --checkpoint C --train shards/train --val shards/val --labels splits/1pct.txt
    """
    from relicv2.shards.outdir import check_output_file
    from relicv2.shards.subset import class_balanced_keys, write_key_list

    with user_errors(FileNotFoundError, ValueError):
        check_output_file(out, "--out")
        report = class_balanced_keys(shards_dir, fraction, seed=seed, min_per_class=min_per_class,
                                     index_cache=index_cache)
        summary = f"{len(report.keys)} of {report.total} keys, {len(report.per_class)} classes"
        write_key_list(out, report.keys, header=f"relicv2 shards subset {shards_dir} --fraction {fraction} "
                                                f"--seed {seed}\n{summary}")
    counts = sorted(report.per_class.values())
    if report.refused:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(report.refused.items()))
        click.echo(f"left out {sum(report.refused.values())} member(s) or sample(s) the shard reader refuses "
                   f"({reasons}), as every job does; `relicv2 shards verify` names each", err=True)
    click.echo(f"wrote {out}: {summary} ({counts[0]}-{counts[-1]} per class)")

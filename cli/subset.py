"""`relicv2 shards subset`: a seeded class-balanced key list (label splits for `relicv2 eval finetune`)."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import index_cache_option, user_errors


@click.command("subset")
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
    from shards.outdir import check_output_file
    from shards.subset import class_balanced_keys, write_key_list

    with user_errors(FileNotFoundError, ValueError):
        check_output_file(out, "--out")
        report = class_balanced_keys(shards_dir, fraction, seed=seed, min_per_class=min_per_class,
                                     index_cache=index_cache)
        write_key_list(out, report.keys, header=f"relicv2 shards subset {shards_dir} --fraction {fraction} "
                                                f"--seed {seed}\n{len(report.keys)} of {report.total} keys, "
                                                f"{len(report.per_class)} classes")
    counts = sorted(report.per_class.values())
    click.echo(f"wrote {out}: {len(report.keys)} of {report.total} keys, {len(report.per_class)} classes "
               f"({counts[0]}-{counts[-1]} per class)")

"""`relicv2 report`: a static HTML page with PNG figures of a whole run (saliency, views, training, eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from relicv2.cli.options import user_errors

EXISTING = click.Path(exists=True, path_type=Path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The page to write, e.g. demo-out/report.html; figures go to <name>-figures/ beside it.")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Pretraining output folder: its metrics.jsonl gives the loss, lr and kNN curves.")
@click.option("--eval", "eval_json", type=EXISTING, multiple=True,
              help="JSON file written by an eval command's --json, or a folder of them (repeatable).")
@click.option("--saliency-report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="report.json of `relicv2 saliency train`.")
@click.option("--maps", "maps_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder of `relicv2 saliency handcrafted` (MAPS/<method>/<key>.png).")
@click.option("--shards", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Shard set whose images the saliency figure shows; a masked set adds the network's masks.")
@click.option("--views", type=EXISTING, multiple=True,
              help="PNG written by `relicv2 pretrain preview-views` (repeatable: masked and unmasked).")
@click.option("--backgrounds", type=EXISTING, default=None,
              help="Output folder of `relicv2 eval backgrounds` (or its backgrounds.json): the table and composites.")
@click.option("--robustness", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="robustness.json of `relicv2 eval robustness`: adds the robustness section.")
@click.option("--segment", type=EXISTING, multiple=True,
              help="segment.json of `relicv2 eval segment`, or a folder of its outputs (repeatable): adds the "
                   "segmentation section.")
@click.option("--transfer", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="transfer.json of `relicv2 eval transfer` (repeatable): adds the transfer section.")
@click.option("--count", type=click.IntRange(1, 32), default=4, show_default=True,
              help="Images in the saliency figure (and rows of the backgrounds composites).")
@click.option("--title", default="ReLICv2 run report", show_default=True)
def report(out: Path, **inputs: Any) -> None:
    """Build OUT (static HTML, opens in any browser) from the files the jobs wrote; missing parts say "not run"."""
    from relicv2.evaluation.report.html import ReportInputs, build_report

    with user_errors(ValueError, OSError):
        summary = build_report(ReportInputs(**inputs), out)
    for section, status in summary.sections.items():
        click.echo(f"  {section:18s} {status}")
    for problem in summary.problems:
        click.echo(f"  left out: {problem}", err=True)
    click.echo(f"wrote {out} ({len(summary.figures)} figures in {out.parent / (out.stem + '-figures')})")
    if all(status != "ok" for status in summary.sections.values()):
        # A page of "not run" sections is written (it says what is missing), but a script must notice.
        raise click.ClickException("no section could be built from the given inputs; check the paths above")

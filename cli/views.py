"""`relicv2 pretrain preview-views`: a PNG grid of the augmented views of a few images."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import user_errors


@click.command()
@click.option("--shards", "shards", required=True, type=click.Path(path_type=Path),
              help="Shard set: a folder (ours, or plain WebDataset tars), a brace pattern or one .tar.")
@click.option("--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="PNG file to write.")
@click.option("--count", default=4, show_default=True, type=click.IntRange(1, 64), help="Images (grid rows).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--mask-probability", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="p_m for the preview (the paper trains with 0.1); masked views get an orange frame.")
@click.option("--backend", default="dali", show_default=True, type=click.Choice(["dali", "reference"]))
@click.option("--large-size", default=224, show_default=True, type=int)
@click.option("--small-size", default=96, show_default=True, type=int)
def preview_views(shards: Path, output: Path, count: int, seed: int, mask_probability: float, backend: str,
                  large_size: int, small_size: int) -> None:
    """Write a PNG grid of the augmented views of a few images (rows: images; columns: views)."""
    from pretrain.views.config import ViewConfig
    from pretrain.views.preview import write_view_grid

    with user_errors(ValueError, FileNotFoundError):
        views = ViewConfig(mask_probability=mask_probability, backend=backend, large_size=large_size,
                           small_size=small_size, num_threads=1)
        summary = write_view_grid(shards, output, views, count=count, seed=seed)
    click.echo(f"wrote {summary['output']}: {count} images x {summary['views']} views, {summary['masked_views']} masked "
               f"({summary['backend']}); keys: {', '.join(summary['keys'])}")

"""`relicv2 demo-data`: write the built-in demo image tree."""

from __future__ import annotations

from pathlib import Path

import click

from relicv2.shards.demo import MIN_SIZE, write_demo_images


@click.command()
@click.argument("output", type=click.Path(file_okay=False, path_type=Path))
@click.option("--train-per-class", type=click.IntRange(min=1), default=24, show_default=True,
              help="Random crops per class for train.")
@click.option("--val-per-class", type=click.IntRange(min=1), default=16, show_default=True,
              help="Random crops per class for val, each under its own lighting.")
@click.option("--size", type=click.IntRange(min=MIN_SIZE), default=128, show_default=True,
              help=f"Side of each square crop in pixels (at least {MIN_SIZE}, the smallest side shards build accepts).")
@click.option("--seed", default=0, show_default=True)
def demo_data(output: Path, **options: int) -> None:
    """Write OUTPUT/{train,val}/<class>/*.jpg from photos bundled with scikit-image (no download)."""
    if output.exists() and not output.is_dir():
        raise click.ClickException(f"{output} is an existing file, not a folder; choose a folder path")
    try:
        counts = write_demo_images(output, **options)  # train_per_class, val_per_class, size, seed
    except OSError as exc:
        raise click.ClickException(f"cannot write {exc.filename or output}: {exc.strerror or exc}; "
                                   "choose a writable folder") from None
    click.echo(f"wrote {counts['train']} train and {counts['val']} val demo images under {output}")

"""`relicv2 demo-data`: write the built-in demo image tree."""

from __future__ import annotations

from pathlib import Path

import click

from shards.demo import write_demo_images


@click.command()
@click.argument("output", type=click.Path(file_okay=False, path_type=Path))
@click.option("--train-per-class", default=24, show_default=True, help="Random crops per class for train.")
@click.option("--val-per-class", default=8, show_default=True, help="Random crops per class for val.")
@click.option("--size", default=128, show_default=True, help="Side of each square crop in pixels.")
@click.option("--seed", default=0, show_default=True)
def demo_data(output: Path, train_per_class: int, val_per_class: int, size: int, seed: int) -> None:
    """Write OUTPUT/{train,val}/<class>/*.jpg from photos bundled with scikit-image (no download)."""
    counts = write_demo_images(output, train_per_class=train_per_class, val_per_class=val_per_class,
                               size=size, seed=seed)
    click.echo(f"wrote {counts['train']} train and {counts['val']} val demo images under {output}")

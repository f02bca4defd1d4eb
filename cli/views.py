"""`relicv2 pretrain preview-views`."""

import click


@click.command()
def preview_views() -> None:
    """Write a PNG grid of the augmented views of a few images."""
    raise click.ClickException("view preview is not available yet")

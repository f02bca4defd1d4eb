"""`relicv2 saliency ...` commands."""

import click


@click.group()
def saliency_group() -> None:
    """Handcrafted saliency maps, evaluation and previews."""

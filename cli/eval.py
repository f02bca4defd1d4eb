"""`relicv2 eval ...` commands."""

import click


@click.group()
def eval_group() -> None:
    """Evaluate pretrained encoders (kNN)."""

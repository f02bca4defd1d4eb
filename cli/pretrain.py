"""`relicv2 pretrain run` (the default of `relicv2 pretrain`)."""

import click


@click.command()
def run() -> None:
    """Pretrain with ReLICv2."""
    raise click.ClickException("pretraining is not available yet")

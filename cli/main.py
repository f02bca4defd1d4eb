"""The `relicv2` command: one click group per stage, each defined in its own module."""

from __future__ import annotations

import click

from cli.demo import demo_data
from cli.eval import eval_group
from cli.pretrain import run as pretrain_run
from cli.saliency import saliency_group
from cli.shards import shards_group
from cli.views import preview_views


class DefaultCommandGroup(click.Group):
    """A group that runs `default_command` when the first argument is not a sub-command.

    `relicv2 pretrain --config X` trains, while `relicv2 pretrain preview-views ...` previews;
    click has no built-in default sub-command, so the dispatch is done here.
    """

    def __init__(self, *args, default_command: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_command = default_command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            if not (args and args[0] in ("--help", "-h")):
                args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="relicv2")
def cli() -> None:
    """ReLICv2 pretraining with saliency masking: shards, saliency, pretrain, eval."""


@cli.group(cls=DefaultCommandGroup, default_command="run")
def pretrain() -> None:
    """Pretrain a ResNet with ReLICv2 (`relicv2 pretrain [run] ...`), or preview its views."""


pretrain.add_command(pretrain_run, name="run")
pretrain.add_command(preview_views, name="preview-views")
cli.add_command(shards_group, name="shards")
cli.add_command(saliency_group, name="saliency")
cli.add_command(eval_group, name="eval")
cli.add_command(demo_data, name="demo-data")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

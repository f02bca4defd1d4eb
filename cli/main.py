"""The `relicv2` command: one click group per stage, each defined in its own module and imported only when
its command runs (or its help is shown), so that `relicv2 shards build` does not pay for torch and DALI."""

from __future__ import annotations

import importlib
import signal
from concurrent.futures.process import BrokenProcessPool

import click

from relicv2.cli import signals


class LazyGroup(click.Group):
    """A click group whose sub-commands are named as "module:attribute" and imported on first use; with
    `default_command`, arguments that do not start with a sub-command name go to that command (`relicv2
    pretrain --config X` trains). click has neither lazy loading nor default sub-commands built in."""

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str]] | None = None,
                 default_command: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})  # name -> (import path, short help)
        self.default_command = default_command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_commands))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands and name not in self.commands:
            module_name, attribute = self.lazy_commands[name][0].split(":")
            self.add_command(getattr(importlib.import_module(module_name), attribute), name=name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from the table, so `--help` imports nothing heavy.
        rows = [(name, self.lazy_commands[name][1] if name in self.lazy_commands
                 else self.commands[name].get_short_help_str(limit=formatter.width))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if self.default_command and args and args[0] not in self.list_commands(ctx) \
                and args[0] not in ("--help", "-h"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


class RootGroup(LazyGroup):
    """The `relicv2` group: SIGINT (Ctrl-C) or SIGTERM anywhere outside the training loop (which
    checkpoints and stops itself) ends the workers and the command with one line and exit 130 / 143,
    not click's "Aborted!" and exit 1 (`cli.signals`); a worker process that died (the system's
    out-of-memory killer, say) in any job's pool is one line and exit 1, not the pool's traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenProcessPool:  # every job's pools are `jobs.workers.worker_pool`s; each job resumes
            from relicv2.jobs.workers import worker_died

            raise click.ClickException(worker_died()) from None
        except KeyboardInterrupt:
            ctx.exit(signals.stop(signal.SIGINT))
        except signals.Terminated:
            ctx.exit(signals.stop(signal.SIGTERM))


@click.group(cls=RootGroup, context_settings={"help_option_names": ["-h", "--help"]}, lazy_commands={
    "shards": ("relicv2.cli.shards:shards_group", "Build, verify, index and subset WebDataset shard sets (and merge a multi-rank build)."),
    "saliency": ("relicv2.cli.saliency:saliency_group", "Saliency: handcrafted maps, the refined network (train, build-masks), scores, previews."),
    "eval": ("relicv2.cli.eval:eval_group", "Evaluate pretrained encoders (kNN, linear, fine-tuning)."),
    "demo-data": ("relicv2.cli.demo:demo_data", "Write the built-in demo image tree (no download)."),
    "report": ("relicv2.cli.report:report", "Write a static HTML report (PNG figures) of a run's outputs."),
    "export": ("relicv2.cli.export:export", "Write a checkpoint's encoder as a plain (torchvision) state dict + JSON."),
    "import-official": ("relicv2.cli.export:import_official", "Convert the authors' released JAX ReLICv2 weights."),
})
@click.version_option(package_name="relicv2")
def cli() -> None:
    """ReLICv2 pretraining with saliency masking: shards, saliency, pretrain, eval."""


@cli.group(cls=LazyGroup, default_command="run", lazy_commands={
    "run": ("relicv2.cli.pretrain:run", "Pretrain with ReLICv2 (the default: `relicv2 pretrain --config ...`)."),
    "preview-views": ("relicv2.cli.pretrain:preview_views", "Write a PNG grid of the augmented views of a few images."),
})
def pretrain() -> None:
    """Pretrain a ResNet with ReLICv2, or preview its augmented views.

    `relicv2 pretrain --config C ...` is `relicv2 pretrain run --config C ...`.
    """


def main() -> None:
    signals.install()
    try:
        cli()
    finally:
        stopped = signals.received()
        if stopped is not None:  # also where the job turned the signal into another error
            raise SystemExit(signals.stop(stopped))


if __name__ == "__main__":
    main()

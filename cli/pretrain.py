"""`relicv2 pretrain run` (the default of `relicv2 pretrain`) and `relicv2 pretrain preview-views`."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import click

from relicv2.cli.options import user_errors
from relicv2.cli.signals import EXIT_CODES
from relicv2.jobs.version import package_version
from relicv2.pretrain.config import ConfigError, describe, load_config
from relicv2.pretrain.views.config import BACKENDS, ViewConfig


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_name", metavar="NAME|FILE.yaml", required=True,
              help="A preset shipped with relicv2 (demo-cpu, imagenette-r18-cpu, imagenet-r50-1000ep) or a YAML "
                   "file of the same sections. Relative data paths in it are read against the current directory.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config value (repeatable), e.g. --set optim.base_lr=0.2.")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Output folder (checkpoints, metrics.jsonl, tensorboard/, config.yaml); same as --set run.output_dir=...")
@click.option("--resume", type=click.Path(path_type=Path), default=None,
              help="Checkpoint to resume from. Default: the newest checkpoint in the output folder, if any.")
@click.option("--fresh", is_flag=True,
              help="Start anew: an earlier run's checkpoints and logs in the output folder are moved to previous-<time>/.")
@click.option("--print-config", is_flag=True, help="Print the resolved settings (YAML) and exit without training.")
def run(config_name: str, overrides: tuple[str, ...], output: Path | None, resume: Path | None, fresh: bool,
        print_config: bool) -> None:
    """Pretrain a ResNet with ReLICv2 (one process, or every rank under torchrun).

    \b
    relicv2 pretrain --config demo-cpu
    relicv2 pretrain --config imagenette-r18-cpu --print-config
    torchrun --nproc_per_node 8 -m relicv2 pretrain --config imagenet-r50-1000ep \\
        --set data.train_shards=/data/shards/masked-train
    """
    if output is not None:
        overrides = (*overrides, f"run.output_dir={output}")
    if fresh and resume is not None:
        raise click.UsageError("--fresh starts anew and --resume continues a run: give one of them")
    with user_errors(ConfigError):
        config = load_config(config_name, overrides)
    if print_config:
        click.echo(describe(config, version=package_version()), nl=False)
        return
    # late: `--help` and `--print-config` stay fast (no torch)
    from relicv2.models.torchfile import TorchFileError
    from relicv2.pretrain.run import OutOfMemory, run_pretraining
    from relicv2.pretrain.stop import PretrainingInterrupted
    from relicv2.pretrain.trainer import NonFiniteLossError

    try:
        with user_errors(ConfigError, TorchFileError, NonFiniteLossError, OutOfMemory):
            result = run_pretraining(config, resume=resume, fresh=fresh)
    except PretrainingInterrupted as stopped:
        click.echo(str(stopped), err=True)
        raise SystemExit(EXIT_CODES[signal.Signals[stopped.signal_name]]) from None
    click.echo(f"done: {result.step} steps ({result.skipped_steps} skipped); last checkpoint {result.last_checkpoint}")


@click.command()
@click.option("--shards", "shards", required=True, type=click.Path(path_type=Path),
              help="Shard set: a folder (ours, or plain WebDataset tars), a brace pattern or one .tar.")
@click.option("--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="PNG file to write.")
@click.option("--count", default=4, show_default=True, type=click.IntRange(1, 64), help="Images (grid rows).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--mask-probability", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="p_m for the preview (the paper trains with 0.1); masked views get an orange frame.")
@click.option("--backend", default=ViewConfig.backend, show_default=True, type=click.Choice(BACKENDS))
@click.option("--large-size", default=ViewConfig.large_size, show_default=True, type=int)
@click.option("--small-size", default=ViewConfig.small_size, show_default=True, type=int)
def preview_views(shards: Path, output: Path, count: int, seed: int, **view_options: Any) -> None:
    """Write a PNG grid of the augmented views of a few images (rows: images; columns: views)."""
    from relicv2.pretrain.views.preview import write_view_grid

    with user_errors(ValueError, FileNotFoundError):
        views = ViewConfig(num_threads=1, **view_options)  # mask_probability, backend, large_size, small_size
        summary = write_view_grid(shards, output, views, count=count, seed=seed)
    click.echo(f"wrote {summary['output']}: {count} images x {summary['views']} views, {summary['masked_views']} masked "
               f"({summary['backend']}); keys: {', '.join(summary['keys'])}")

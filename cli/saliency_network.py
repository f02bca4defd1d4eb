"""`relicv2 saliency train | build-masks`: the DeepUSPS-style saliency network and masked shard sets."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import SHARDS_HELP, index_cache_option, user_errors
from jobs.config import ConfigError
from jobs.lock import FolderLockedError
from saliency.network.config import PRESETS, load_saliency_config

# Modules that import torch are imported inside the commands: `relicv2 saliency --help` stays fast.


@click.command("train")
@click.option("--shards", required=True, type=click.Path(path_type=Path),
              help=f"Shard set to sample images from: {SHARDS_HELP}.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder (model.pt, report.json, caches).")
@click.option("--config", "config_name", metavar="NAME|FILE.yaml",
              help="Settings: a preset (tiny, demo, cpu, paper; see the error without it for what each is for) or "
                   "a YAML file of the same keys. Required: there is no default, since the paper's run takes hours.")
@click.option("--preset", "preset_name", metavar="NAME", help="Same as --config NAME (kept for existing commands).")
@click.option("--backbone", required=True,
              help="Encoder weights: a relicv2 pretrain run folder or checkpoint, a torchvision/SwAV ResNet "
                   "state dict, or 'random' (not recommended).")
@click.option("--gt", type=click.Path(path_type=Path), help="Ground-truth masks named like the sample keys (report only).")
@click.option("--eval-shards", type=click.Path(path_type=Path),
              help="Held-back shard set to score the fused network on (needs --gt).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a setting (repeatable), e.g. --set epochs=5 --set thresholds.mr=0.3 --set crf.iterations=3")
@index_cache_option
@click.option("--progress/--no-progress", default=True, show_default=True)
def train_command(shards: Path, out: Path, config_name: str | None, preset_name: str | None, backbone: str,
                  gt: Path | None, eval_shards: Path | None, overrides: tuple[str, ...], index_cache: Path | None,
                  progress: bool) -> None:
    """Refine the handcrafted maps (phase I) and train the fused saliency network (phase II).

    \b
    relicv2 saliency train --config cpu --shards shards/train --out runs/saliency --backbone runs/imagenette-r18-cpu
    """
    if config_name is not None and preset_name is not None:
        raise click.UsageError("--preset is another name for --config: give one of them")
    config_name = config_name or preset_name
    if config_name is None:
        raise click.UsageError(f"choose the settings with --config NAME; {PRESETS.listing()}")
    from pretrain.checkpoint import CheckpointError
    from saliency.network.train import TrainJob, TrainStateError, run_train
    from saliency.network.weights import BackboneError

    with user_errors(ConfigError, BackboneError, CheckpointError, TrainStateError, FolderLockedError,
                     FileNotFoundError, ValueError):
        config = load_saliency_config(config_name, overrides)
        run_train(TrainJob(shards=shards, out=out, config=config, backbone=backbone, gt=gt,
                           eval_shards=eval_shards, progress=progress, index_cache=index_cache), log=click.echo)


@click.command("build-masks")
@click.option("--model", required=True, type=click.Path(path_type=Path), help="model.pt from `saliency train`.")
@click.option("--shards", required=True, type=click.Path(path_type=Path), help=f"Input shard set: {SHARDS_HELP}.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder for the masked shard set.")
@click.option("--config", "config_name", metavar="NAME|FILE.yaml",
              help="Settings: a preset (cpu, gpu; see the error for an unknown name) or a YAML file of the same keys. "
                   "[default: the defaults, printed at start]")
@click.option("--workers", type=click.IntRange(min=0), default=None,
              help="Processes for decoding, resizing and mask encoding (0: all in this process). "
                   "[default: this rank's CPU cores less one]")
@click.option("--batch", "batch_size", type=click.IntRange(min=1), default=None, help="Images per forward pass.")
@click.option("--device", default=None, help="auto (CUDA when a GPU is visible, else the CPU), cpu or cuda[:N].")
@index_cache_option
@click.option("--merge-timeout", "merge_timeout_s", type=float, default=None,
              help="Under torchrun: seconds rank 0 waits for the other ranks before merging.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a setting (repeatable), e.g. --set batch_size=64 --set device=cuda:1")
@click.option("--flip/--no-flip", default=None,
              help="Average each mask with the mirrored image's (twice the forward pass). [default: off]")
@click.option("--crf/--no-crf", default=None,
              help="Refine each mask with the dense CRF the model was trained with (CPU work in the workers). "
                   "[default: off]")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar. [default: on]")
def build_masks_command(config_name: str | None, overrides: tuple[str, ...], **options) -> None:
    """Write a masked shard set: every sample's original image plus an 8-bit soft mask (mask.png).

    Settings: the defaults <- --config <- the options given <- --set; printed at start and saved as
    OUT/config.yaml.
    """
    from saliency.network import build_masks as job
    from saliency.network.model_file import ModelFileError

    with user_errors(ConfigError, ModelFileError, job.MasksError, FolderLockedError, FileNotFoundError,
                     ValueError):
        config = job.load_masks_config(config_name, overrides, **options)
        summary = job.build_masks(config)
    if summary is not None:
        click.echo(job.format_summary(summary))
        if summary["written"] == 0:
            raise click.ClickException("no sample could be masked: every input failed")


def register(group: click.Group) -> None:
    """Add `train` and `build-masks` to the `saliency` command group."""
    group.add_command(train_command)
    group.add_command(build_masks_command)

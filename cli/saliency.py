"""`relicv2 saliency handcrafted | evaluate | preview | train | build-masks`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from relicv2.cli.options import config_or_preset, index_cache_option, preset_option, user_errors
from relicv2.jobs.config import ConfigError
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import FolderLockedError
from relicv2.saliency.handcrafted import METHOD_NAMES, resolve_methods
from relicv2.saliency.network.config import PRESETS, load_saliency_config
from relicv2.shards.driver import REHASH_OPTION

# A command's job modules are imported inside it: torch, and the handcrafted methods with their numba, scipy
# and OpenCV, cost seconds of CPU that `relicv2 saliency --help` and the other commands do not need.

METHOD_HELP = f"One of {', '.join(METHOD_NAMES)}, a comma-separated list, or 'all'."
SHARDS_HELP = ("a folder (from `relicv2 shards build`, or plain WebDataset tars such as train-0000.tar), "
               "a brace pattern (train-{0000..0099}.tar) or a tar")


def _methods(name: str) -> tuple[str, ...]:
    with user_errors(ValueError, option="--method"):
        return tuple(resolve_methods(name))


@click.group()
def saliency_group() -> None:
    """Saliency: handcrafted maps, the refined network (train, build-masks), scores, previews."""


@saliency_group.command("handcrafted")
@click.option("--method", "method", default="all", show_default=True, help=METHOD_HELP)
@click.option("--input", required=True, type=click.Path(path_type=Path),
              help="Image folder, shard folder (*-NNNN.tar), brace pattern ('train-{0000..0099}.tar') or one .tar.")
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="Output folder; maps go to OUTPUT/<method>/<name>.png.")
@click.option("--workers", default=1, show_default=True, help="Worker processes (one core each).")
@click.option("--overwrite", is_flag=True, help="Recompute maps that already exist (default: skip them, so reruns resume).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--max-failures", default="0", show_default=True,
              help="Failed inputs accepted before the job counts as failed (exit 1): a count (10), a "
                   "fraction (0.05) or a percentage (5%). A job whose every input fails always fails.")
def handcrafted(method: str, workers: int, max_failures: str, **options: Any) -> None:
    """Write 8-bit PNG saliency maps of RBD, MR, DSR and/or MC for every input image."""
    from relicv2.saliency.batch import (
        FailureLimit,
        HandcraftedConfig,
        OutputWriteError,
        run_handcrafted,
    )

    with user_errors(ValueError, option="--max-failures"):
        limit = FailureLimit.parse(max_failures)
    if workers < 1:
        raise click.BadParameter(f"{workers}: give at least 1 worker", param_hint="--workers")
    config = HandcraftedConfig(methods=_methods(method), workers=workers, max_failures=limit, **options)
    with user_errors(FileNotFoundError, ValueError, FolderLockedError, OutputWriteError):
        report = run_handcrafted(config)
    if report.stale_removed:
        click.echo(f"removed {report.stale_removed} temporary file(s) left by an interrupted run", err=True)
    click.echo(f"{report.summary(config.methods)} -> {config.output}")
    failure = report.failure(config.max_failures)
    if failure is not None:
        click.echo(f"error: {failure}; rerun the same command after fixing the inputs, or raise --max-failures",
                   err=True)
        raise SystemExit(1)


@saliency_group.command("evaluate")
@click.option("--pred", type=click.Path(path_type=Path),
              help="Folder of maps, or of per-method sub-folders of maps.")
@click.option("--model", "model_path", type=click.Path(path_type=Path),
              help="Instead of --pred: a saved saliency model (model.pt of `saliency train`, or its --out folder) "
                   "run on --images.")
@click.option("--images", type=click.Path(path_type=Path), help="With --model: the folder of images to predict.")
@click.option("--flip", is_flag=True, help="With --model: average each map with the mirrored image's.")
@click.option("--crf", is_flag=True, help="With --model: refine each map with the dense CRF the model was trained with.")
@click.option("--maps", type=click.Path(path_type=Path),
              help="With --model: average each map with the mean of these handcrafted maps "
                   "(the --output folder of `saliency handcrafted` on the same images).")
@click.option("--device", default="auto", show_default=True, help="With --model: auto, cpu or cuda[:N].")
@click.option("--gt", required=True, type=click.Path(path_type=Path), help="Folder of ground-truth masks (same stems).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the scores as JSON.")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Also write the scores as CSV.")
@click.option("--allow-missing", is_flag=True, help="Score only images that have both a map and a mask.")
def evaluate_command(pred: Path | None, model_path: Path | None, images: Path | None, flip: bool, crf: bool,
                     maps: Path | None, device: str, gt: Path, json_path: Path | None, csv_path: Path | None, allow_missing: bool) -> None:
    """Print MAE, max-F, adaptive-F (beta^2 = 0.3) and S-measure per method, or of a saved model.

    \b
    relicv2 saliency evaluate --pred maps/ --gt masks/
    relicv2 saliency evaluate --model runs/saliency --images images/ --gt masks/
    """
    from relicv2.saliency.evaluate import (
        EvaluateConfig,
        EvaluationError,
        ModelEvaluation,
        evaluate,
        evaluate_model,
        format_table,
        write_csv,
        write_json,
    )

    if (pred is None) == (model_path is None):
        raise click.UsageError("give either --pred (maps) or --model with --images")
    if model_path is None and (images or flip or crf or maps):
        raise click.UsageError("--images, --flip, --crf and --maps go with --model")
    if model_path is not None and images is None:
        raise click.UsageError("--model needs --images, the folder of images to predict")
    with user_errors(EvaluationError, ConfigError, ValueError):
        if model_path is None:
            results = evaluate(EvaluateConfig(pred=pred, gt=gt, allow_missing=allow_missing))
        else:
            job = ModelEvaluation(model=model_path, images=images, gt=gt, flip=flip, crf=crf, maps=maps,
                                  allow_missing=allow_missing, device=resolve_device(device, "--device"))
            results = {str(model_path): evaluate_model(job)}
    click.echo(format_table(results))
    if json_path:
        write_json(results, json_path)
    if csv_path:
        write_csv(results, csv_path)


@saliency_group.command("preview")
@click.option("--input", required=True, type=click.Path(path_type=Path), help="Image folder or shard set.")
@click.option("--output", required=True, type=click.Path(path_type=Path), help="PNG file to write.")
@click.option("--method", "method", default="all", show_default=True, help=METHOD_HELP)
@click.option("--count", default=6, show_default=True, help="Number of images (the first ones).")
@click.option("--gt", type=click.Path(path_type=Path), help="Folder of ground-truth masks to show too.")
@click.option("--maps", type=click.Path(path_type=Path), help="Read maps written by `handcrafted` instead of computing them.")
def preview(method: str, count: int, **options: Any) -> None:
    """Write a contact sheet: image | each method's map | GT, one row per image."""
    from relicv2.saliency.preview import PreviewConfig, write_preview

    with user_errors(FileNotFoundError, ValueError):
        path = write_preview(PreviewConfig(methods=_methods(method), count=max(1, count), **options))
    click.echo(f"wrote {path}")


@saliency_group.command("train")
@click.option("--shards", required=True, type=click.Path(path_type=Path),
              help=f"Shard set to sample images from: {SHARDS_HELP}.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder (model.pt, report.json, caches).")
@click.option("--config", "config_name", metavar="NAME|FILE.yaml",
              help="Settings: a preset (tiny, demo, cpu, paper; see the error without it for what each is for) or "
                   "a YAML file of the same keys. Required: there is no default, since the paper's run takes hours.")
@preset_option
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
def train_command(config_name: str | None, preset_name: str | None, overrides: tuple[str, ...], **job: Any) -> None:
    """Refine the handcrafted maps (phase I) and train the fused saliency network (phase II).

    \b
    relicv2 saliency train --config cpu --shards shards/train --out runs/saliency --backbone runs/imagenette-r18-cpu
    """
    config_name = config_or_preset(config_name, preset_name)
    if config_name is None:
        raise click.UsageError(f"choose the settings with --config NAME; {PRESETS.listing()}")
    from relicv2.saliency.network.train import TrainJob, TrainStateError, run_train

    # ValueError: a torch file's error (models.torchfile), the --backbone's among them; OSError: a full disk
    with user_errors(ConfigError, TrainStateError, FolderLockedError, FileNotFoundError, ValueError, path=job["out"]):
        config = load_saliency_config(config_name, overrides)
        run_train(TrainJob(config=config, **job), log=click.echo)


@saliency_group.command("build-masks")
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
@click.option(REHASH_OPTION, "rehash_shards", is_flag=True, default=None,
              help="Hash every finished masked shard and rebuild those whose bytes changed (bit rot); a plain "
                   "rerun reads none.")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar. [default: on]")
def build_masks_command(config_name: str | None, overrides: tuple[str, ...], **options) -> None:
    """Write a masked shard set: every sample's original image plus an 8-bit soft mask (mask.png).

    Settings: the defaults <- --config <- the options given <- --set; printed at start and saved as
    OUT/config.yaml.
    """
    from relicv2.saliency.network.build_masks import build_masks, format_summary
    from relicv2.saliency.network.config import MasksError, load_masks_config

    # ValueError: a torch file's error (models.torchfile), the --model's among them
    with user_errors(ConfigError, MasksError, FolderLockedError, FileNotFoundError, ValueError):
        config = load_masks_config(config_name, overrides, **options)
        summary = build_masks(config)
    if summary is not None:
        click.echo(format_summary(summary))
        if summary["written"] == 0:
            raise click.ClickException("no sample could be masked: every input failed")


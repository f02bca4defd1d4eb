"""`relicv2 eval ...` commands: parse the options, build the job, call its library function."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from relicv2.cli.options import config_or_preset, preset_option, user_errors
from relicv2.jobs.config import ConfigError, parse_overrides
from relicv2.pretrain.config import KnnConfig  # light (no torch): the one owner of the kNN defaults
from relicv2.pretrain.views.config import CENTRE_CROP

KNN = KnnConfig()
PATH = click.Path(path_type=Path)
_to_stderr = functools.partial(click.echo, err=True)
ALLOW_LOST_OPTION = click.option(
    "--allow-lost", is_flag=True,
    help="Score a set that lost samples while read (truncated or missing tars) instead of refusing it; "
         "the loss is printed and in the JSON.")


@click.group()
def eval_group() -> None:
    """Evaluate pretrained encoders (kNN, linear probe, fine-tuning, transfer, segmentation, robustness,
    backgrounds)."""


def _options(*options: Callable) -> Callable:
    """The click options in the order given (the first on top of --help)."""
    def decorate(function):
        for option in reversed(options):
            function = option(function)
        return function
    return decorate


def _encoder_options(*more: Callable) -> Callable:
    """The options of every command (the encoder, the device, the seed of a random one) around `more`; the
    command gets the encoder as `backbone`."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def command(checkpoint: Path | None, random_depth: int | None, network: str, seed: int, **options: Any):
            return function(backbone=_backbone(checkpoint, random_depth, network, seed), **options)
        return encoder_options(command)

    encoder_options = _options(
        click.option("--checkpoint", type=PATH, default=None,
                     help="Pretraining checkpoint, run folder (newest checkpoint) or exported encoder file."),
        click.option("--random-init", "random_depth", type=click.IntRange(min=18), default=None, metavar="DEPTH",
                     help="Instead of a checkpoint, a randomly initialised ResNet-DEPTH (the baseline, with --seed)."),
        click.option("--network", type=click.Choice(["online", "target"]), default="online", show_default=True),
        *more,
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-init."),
    )
    return decorate


def _output_option(help: str, required: bool = True) -> Callable:
    return click.option("--output", type=PATH, required=required, default=None, help=help)


def _json_option(help: str = "Also write the result as JSON to this file.") -> Callable:
    return click.option("--json", "json_path", type=PATH, default=None, help=help)


def _config_option(help: str) -> Callable:
    return click.option("--config", "config_name", metavar="NAME|FILE.yaml", default=None, help=help)


def _set_option(example: str, what: str = "one setting") -> Callable:
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help=f"Override {what}, e.g. {example} (repeatable).")


def _labelled_options(train_help: str, val_help: str, json_help: str) -> tuple[Callable, ...]:
    return (click.option("--train", "train_shards", type=PATH, required=True, help=train_help),
            click.option("--val", "val_shards", type=PATH, required=True, help=val_help), _json_option(json_help))


_TRAINED_HEAD_OPTIONS = (
    *_labelled_options("Labelled shard set to train the head on.", "Labelled shard set to score.",
                       "Also write the result as JSON to this file."),
    _output_option("Folder for caches, head checkpoints (resumed on rerun), config.yaml and result.json.",
                   required=False),
    _set_option("--set epochs=10", what="one setting of the preset"),
    preset_option,
)


def _backbone(checkpoint: Path | None, random_depth: int | None, network: str, seed: int) -> Any:
    """The `Backbone` of the encoder options; giving neither or both encoders is a usage error."""
    from relicv2.evaluation.job import Backbone

    try:
        return Backbone(checkpoint=checkpoint, random_depth=random_depth, network=network, seed=seed)
    except ConfigError as error:
        raise click.UsageError(str(error)) from None


def _settings(load: Callable, name: str, overrides: tuple[str, ...]) -> Any:
    """The settings of preset or file `name` with the --set overrides; a mistake is a usage error."""
    with user_errors(ConfigError, option="--config/--set"):
        return load(name, overrides)


def _echo_run(run: Callable[..., Any], *args: Any, lines: Callable[[Any], list[str]] = list, **kwargs: Any) -> None:
    """Call the job; print its `lines`; an error a user can cause is one line."""
    from relicv2.jobs.lock import FolderLockedError

    with user_errors(FolderLockedError, FileNotFoundError, ValueError):  # shard, class, torch-file errors too
        result = run(*args, **kwargs)
    for line in lines(result):
        click.echo(line)


def _run(**job_fields: Any) -> None:
    """Build the `EvalJob` and run it: the outcome on stdout, shortfalls on stderr, errors as one line."""
    from relicv2.evaluation.job import ALLOW_LOST_HINT, EvalJob, run_eval
    from relicv2.jobs.lock import FolderLockedError
    from relicv2.pretrain.knn.outcome import LostSamplesError

    try:
        outcome = run_eval(EvalJob(**job_fields), log=click.echo)
    except LostSamplesError as error:
        raise click.ClickException(f"{error}{ALLOW_LOST_HINT}") from None
    # A torch file's error and a --train or --val naming no usable set (ShardSetError) are ValueErrors: exit 1,
    # as in every other command.
    except (FolderLockedError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    if outcome is None:  # a rank other than 0
        return
    for line in outcome.lines:
        click.echo(line)
    for line in outcome.warnings:
        _to_stderr(line)


@eval_group.command("knn")
@_encoder_options(
    *_labelled_options("Labelled shard set whose features form the bank.", "Labelled shard set to classify.",
                       "Also write the result as JSON (protocol, checkpoint, top1, num_train, ...) to this file."),
    click.option("--k", type=click.IntRange(min=1), default=None, help=f"Neighbours that vote [default: {KNN.k}]."),
    click.option("--temperature", type=float, default=None,
                 help=f"Vote weight exp(cos / T) [default: {KNN.temperature}]."),
    click.option("--crop-size", type=click.IntRange(min=8), default=None,
                 help=f"Centre crop [default: {KNN.crop_size}]."),
    click.option("--resize-size", type=click.IntRange(min=0), default=None,
                 help=f"Short side before the centre crop; 0 means crop-size / {CENTRE_CROP} [default: {KNN.resize_size}]."),
    click.option("--batch-size", type=click.IntRange(min=1), default=None, help=f"[default: {KNN.batch_size}]"),
)
@ALLOW_LOST_OPTION
def knn(**options: Any) -> None:
    """Weighted cosine kNN top-1 of an encoder: train features as the bank (defaults: pretrain.config.KnnConfig)."""
    from relicv2.evaluation.job import knn_settings

    given = {name: options.pop(name) for name in ("k", "temperature", "crop_size", "resize_size", "batch_size")}
    try:
        settings = knn_settings(given)
    except ConfigError as error:
        raise click.UsageError(str(error)) from None
    _run(config=settings, given=frozenset(name for name, value in given.items() if value is not None), **options)


def _run_configured(load: Any, default: str, config_name: str | None, preset_name: str | None,
                    overrides: tuple[str, ...], **options: Any) -> None:
    """`_run` a protocol that trains a head on its settings: preset or file (`--config`, or its old name
    `--preset`) with the --set overrides."""
    config = _settings(load, config_or_preset(config_name, preset_name) or default, overrides)
    _run(config=config, given=frozenset(parse_overrides(overrides)), **options)


@eval_group.command("linear")
@_encoder_options(*_TRAINED_HEAD_OPTIONS)
@_config_option("paper (default): augmented views, 100 epochs; fast: cached centre-crop features (seconds on "
                "CPU); or a YAML file of LinearConfig keys.")
@ALLOW_LOST_OPTION
def linear(**options: Any) -> None:
    """Linear probe of a frozen encoder: top-1 / top-5 (paper protocol or the fast cached one).

    \b
    relicv2 eval linear --checkpoint runs/r50 --train shards/train --val shards/val --config fast
    torchrun --nproc_per_node 8 -m relicv2 eval linear --checkpoint C --train T --val V --output out/linear
    """
    from relicv2.evaluation.job import load_linear_config

    _run_configured(load_linear_config, "paper", **options)


@eval_group.command("finetune")
@_encoder_options(*_TRAINED_HEAD_OPTIONS)
@click.option("--labels", type=PATH, required=True,
              help="Key list of the labelled subset (relicv2 shards subset ... --out KEYS.txt).")
@_config_option("1pct (default) or 10pct: the paper's recipe for that label split (batch, head / encoder lr, "
                "weight decay); or a YAML file of FinetuneConfig keys.")
def finetune_command(**options: Any) -> None:
    """Semi-supervised fine-tuning: encoder + new linear head on a labelled key subset, 20 epochs.

    \b
    relicv2 shards subset shards/train --fraction 0.01 --out 1pct.txt
    relicv2 eval finetune --checkpoint runs/r50 --train shards/train --val shards/val --labels 1pct.txt
    """
    from relicv2.evaluation.job import load_finetune_config

    _run_configured(load_finetune_config, "1pct", **options)


@eval_group.command("backgrounds")
@_encoder_options(
    click.option("--head", type=PATH, required=True,
                 help="The head file `relicv2 eval linear --output DIR` wrote (DIR/trained-head.pt) for this encoder."),
    click.option("--val", "val", type=PATH, required=True,
                 help="Labelled shard set to test: `saliency build-masks` output (images with their masks), or any "
                      "labelled set with --masks."),
    click.option("--masks", type=PATH, default=None,
                 help="The masks of --val when it holds none: a shard set of mask.png members keyed like its images, "
                      "or a folder of KEY.png masks (ground truth)."),
    _output_option("Folder for the variant set (resumed on rerun), the scores per variant and backgrounds.json."),
    _json_option("Also write the result (backgrounds.json) here."),
    _config_option("default: the paper's eight variants, pairings from seed 0; or a YAML file of its keys."),
    _set_option("--set seed=1"),
)
def backgrounds(backbone: Any, config_name: str | None,
                overrides: tuple[str, ...], **options: Any) -> None:
    """Does the encoder rely on backgrounds? The ImageNet-9 variants of a val set, made from its masks.

    \b
    relicv2 eval linear --checkpoint runs/r50 --train shards/train --val shards/val --config fast --output lin
    relicv2 eval backgrounds --checkpoint runs/r50 --head lin/trained-head.pt --val masked/val --output bg
    """
    from relicv2.evaluation.background_eval import load_backgrounds_config, run_backgrounds

    config = _settings(load_backgrounds_config, config_name or "default", overrides)
    _echo_run(run_backgrounds, backbone, config=config, log=_to_stderr,
              **options)


@eval_group.command("segment")
@_encoder_options(
    click.option("--data", type=PATH, required=True,
                 help="The set: the folder holding VOCdevkit/ (layout voc), Cityscapes' leftImg8bit/ and gtFine/ "
                      "(layout cityscapes), or images/NAME.jpg with masks/NAME.png (layout folder)."),
    _output_option("Folder for the training state (resumed on rerun), config.yaml and segment.json."),
    _json_option("Also write the result (segment.json: mIoU, per-class IoU) here."),
    _config_option("paper (default): VOC train_aug / val, 45 epochs, crop 513; cityscapes: 160 epochs, crop 769; "
                   "fast: a folder set at 112 px, 10 epochs; or a YAML file of SegmentConfig keys."),
    _set_option("--set binarise=128 --set val_split=val.txt"),
)
def segment(backbone: Any, config_name: str | None,
            overrides: tuple[str, ...], **options: Any) -> None:
    """Semantic segmentation: the encoder in an FCN fine-tuned on a labelled set, scored by mIoU.

    \b
    relicv2 eval segment --checkpoint runs/r50 --data VOC --output out/voc
    relicv2 eval segment --random-init 18 --data pairs --config fast --set binarise=128 \\
        --set train_split=train.txt --set val_split=val.txt --output out/seg
    """
    from relicv2.evaluation.segment import load_segment_config, run_segment

    config = _settings(load_segment_config, config_name or "paper", overrides)
    _echo_run(run_segment, backbone, config=config, log=_to_stderr,
              **options)


def _ood_option(values: tuple[str, ...]) -> tuple[tuple[str, Path], ...]:
    pairs = []
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise click.BadParameter(f"{value!r} is not NAME=FOLDER", param_hint="--ood")
        pairs.append((name, Path(folder)))
    return tuple(pairs)


@eval_group.command("robustness")
@_encoder_options(
    click.option("--head", "head", type=PATH, required=True,
                 help="The encoder's head file: trained-head.pt in the --output of `relicv2 eval linear`."),
    click.option("--val", type=PATH, default=None,
                 help="Labelled val set (shard set, or class folders built into shards in --output) to corrupt."),
    click.option("--imagenet-c", "imagenet_c", type=PATH, default=None,
                 help="The released ImageNet-C folder (corruption/severity/class/image); CE against AlexNet's errors."),
    click.option("--ood", "ood", multiple=True, metavar="NAME=FOLDER",
                 help="An out-of-distribution set: imagenetv2-matched-frequency, imagenetv2-threshold0.7, "
                      "imagenetv2-top-images, imagenet-sketch, imagenet-r, imagenet-a or objectnet (repeatable)."),
    click.option("--control-checkpoint", type=PATH, default=None,
                 help="The control encoder: the corrupted copies' CE is relative to its errors."),
    click.option("--control-random-init", "control_depth", type=click.IntRange(min=18), default=None,
                 metavar="DEPTH", help="A random-init ResNet-DEPTH as the control (with --seed)."),
    click.option("--control-head", type=PATH, default=None, help="The control's head file."),
    _output_option("Folder for the corrupted sets, built shards, cached results (resumed on rerun), config.yaml "
                   "and robustness.json."),
    _json_option(),
    _config_option("full (default): 15 corruptions x severities 1-5; quick: severities 1, 3, 5; or a YAML file "
                   "of RobustnessConfig keys."),
    _set_option("--set severities=1,3,5 --set corruptions=fog,snow"),
)
def robustness(backbone: Any, ood: tuple[str, ...],
               control_checkpoint: Path | None, control_depth: int | None, config_name: str | None,
               overrides: tuple[str, ...], **options: Any) -> None:
    """Zero-shot robustness of a frozen encoder and its linear head: ImageNet-C corruptions, OOD sets.

    \b
    relicv2 eval linear --checkpoint runs/r50 --train T --val V --config fast --output out/linear
    relicv2 eval robustness --checkpoint runs/r50 --head out/linear/trained-head.pt --val V --output out/robust
    """
    from relicv2.evaluation import robustness as job

    config = _settings(job.load_robustness_config, config_name or "full", overrides)
    control = (_backbone(control_checkpoint, control_depth, backbone.network, backbone.seed)
               if control_checkpoint is not None or control_depth is not None else None)
    _echo_run(job.run_robustness, job.RobustnessJob(backbone=backbone, config=config, ood=_ood_option(ood),
                                                    control=control, **options), log=click.echo, lines=job.summary_lines)


@eval_group.command("transfer")
@_encoder_options(
    click.option("--train", type=PATH, required=True,
                 help="Labelled training set: a shard set, or class folders (built into shards in --output)."),
    click.option("--val", type=PATH, default=None,
                 help="Labelled val set the sweep chooses on; without it, a seeded share of each class of --train "
                      "(val_fraction)."),
    click.option("--test", type=PATH, required=True,
                 help="Labelled test set the chosen settings are scored on (after retraining on train + val)."),
    click.option("--finetune", is_flag=True,
                 help="Fine-tune encoder and head (learning rate x weight decay grid) instead of the linear sweep."),
    _output_option("Folder for built shards, the feature cache, each swept point's figures (resumed on rerun), "
                   "config.yaml and transfer.json."),
    _json_option("Also write the result (transfer.json) here."),
    _config_option("paper (default): 45 l2 penalties; fine-tuning 100 epochs over 9 lrs x 6 weight decays; fast: "
                   "fine-tuning 10 epochs over 2 x 2; or a YAML file of TransferConfig keys."),
    _set_option("--set metric=mean_per_class"),
)
def transfer(backbone: Any, config_name: str | None,
             overrides: tuple[str, ...], **options: Any) -> None:
    """Transfer to a labelled set: sweep on train against val, retrain on train + val, score on test.

    \b
    relicv2 eval transfer --checkpoint runs/r50 --train flowers/train --test flowers/test --output out/flowers
    relicv2 eval transfer --checkpoint runs/r50 --train T --val V --test E --finetune --config fast --output out/ft
    """
    from relicv2.evaluation import transfer as job

    config = _settings(job.load_transfer_config, config_name or "paper", overrides)
    _echo_run(job.run_transfer, job.TransferJob(backbone=backbone, config=config, given=frozenset(parse_overrides(
        overrides)), **options), log=_to_stderr, lines=job.summary_lines)

"""`relicv2 eval ...` commands."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pretrain.config import KnnConfig  # light (no torch): the one owner of the kNN defaults
from shards.atomic import atomic_output
from shards.shardset import ShardSetError, shard_tars

KNN = KnnConfig()
ALLOW_LOST_HINT = ", or pass --allow-lost to score the samples that remain (the loss is then in every output)"
ALLOW_LOST_OPTION = click.option(
    "--allow-lost", is_flag=True,
    help="Score a set that lost samples while read (truncated or missing tars) instead of refusing it; "
         "the loss is printed and in the JSON.")


@click.group()
def eval_group() -> None:
    """Evaluate pretrained encoders (kNN, linear probe, semi-supervised fine-tuning)."""


@eval_group.command("knn")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Pretraining checkpoint (checkpoint-*.pt), or a run folder (its newest checkpoint).")
@click.option("--random-init", "random_depth", type=click.IntRange(min=18), default=None, metavar="DEPTH",
              help="Instead of a checkpoint, a randomly initialised ResNet-DEPTH (the baseline).")
@click.option("--network", type=click.Choice(["online", "target"]), default="online", show_default=True)
@click.option("--train", "train_shards", type=click.Path(path_type=Path), required=True,
              help="Labelled shard set whose features form the bank.")
@click.option("--val", "val_shards", type=click.Path(path_type=Path), required=True,
              help="Labelled shard set to classify.")
@click.option("--k", type=click.IntRange(min=1), default=None, help=f"Neighbours that vote [default: {KNN.k}].")
@click.option("--temperature", type=float, default=None,
              help=f"Vote weight exp(cos / T) [default: {KNN.temperature}].")
@click.option("--crop-size", type=click.IntRange(min=8), default=None, help=f"Centre crop [default: {KNN.crop_size}].")
@click.option("--resize-size", type=click.IntRange(min=0), default=None,
              help=f"Short side before the centre crop; 0 means crop-size / 0.875 [default: {KNN.resize_size}].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help=f"[default: {KNN.batch_size}]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-init.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the result as JSON (protocol, checkpoint, top1, num_train, ...) to this file.")
@ALLOW_LOST_OPTION
def knn(checkpoint: Path | None, random_depth: int | None, network: str, train_shards: Path, val_shards: Path,
        k: int | None, temperature: float | None, crop_size: int | None, resize_size: int | None,
        batch_size: int | None, device: str, seed: int, json_path: Path | None, allow_lost: bool) -> None:
    """Weighted cosine kNN top-1 of an encoder: train features as the bank.

    Unset options follow the checkpoint's training (its run's kNN monitor, else its view size), so
    the figure matches the run's own; a random init takes pretrain.config.KnnConfig's defaults."""

    import torch

    from pretrain.checkpoint import CheckpointError
    from pretrain.config import ConfigError, load_config
    from pretrain.eval.knn import evaluate_knn, shared_tars
    from pretrain.eval.outcome import LostSamplesError, lost_text

    if (checkpoint is None) == (random_depth is None):
        raise click.UsageError("give exactly one of --checkpoint or --random-init DEPTH")
    given = {name: value for name, value in {"k": k, "temperature": temperature, "crop_size": crop_size,
                                              "resize_size": resize_size, "batch_size": batch_size}.items()
             if value is not None}
    for name, spec in (("--train", train_shards), ("--val", val_shards)):
        try:
            shard_tars(spec)
        except ShardSetError as error:
            raise click.UsageError(f"{name} {spec}: {error}") from None
    both = shared_tars(train_shards, val_shards)
    if both:
        raise click.UsageError(f"--train and --val share {len(both)} tar(s) ({both[0].name}, ...): each query would "
                               "be found in the bank itself; pass a held-out labelled set as --val")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda but no CUDA device is visible; use --device cpu")
    try:
        encoder, record = _backbone(checkpoint, random_depth, network, seed)
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    trained = record.get("trained_protocol") or {}
    try:  # the kNN settings are checked (positive, finite) by the one dataclass that owns their defaults
        settings = load_config(None, [f"knn.{name}={value}" for name, value in {**trained, **given}.items()]).knn
    except ConfigError as error:
        raise click.UsageError(str(error).replace("--set overrides: knn.", "--").replace("_", "-")) from None
    if "crop_size" in trained and settings.crop_size != trained["crop_size"]:
        click.echo(f"warning: the encoder was evaluated at {trained['crop_size']} px in its own run (or trained on "
                   f"views of that size); --crop-size {settings.crop_size} gives a figure not comparable with it",
                   err=True)
    try:
        result = evaluate_knn(encoder.to(device), train_shards, val_shards, settings=settings, device=device,
                              progress=True, allow_lost=allow_lost)
    except LostSamplesError as error:
        raise click.ClickException(f"{error}{ALLOW_LOST_HINT}") from None
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    assert result is not None  # a single process is rank 0
    what = (f"{record['checkpoint']} ({record['network']})" if checkpoint is not None
            else f"random-init ResNet-{random_depth}")
    source = "the checkpoint's own protocol" if trained else "the defaults"
    click.echo(f"{what}: kNN top-1 {result.top1:.4f} (on {device}, {settings.crop_size} px, k={settings.k}, "
               f"T={settings.temperature}: {source} where not set; "
               f"{result.num_train} train, {result.num_val} val, {result.skipped} undecodable skipped, "
               f"{lost_text(result.lost)} lost while reading)")
    _warn_shortfalls(result)
    if json_path is not None:
        payload = result.as_json(checkpoint=record["checkpoint"], random_init=random_depth,
                                 extra={"network": record["network"]})
        try:
            _write_json(json_path, payload)
        except OSError as error:
            raise click.ClickException(f"cannot write --json {json_path}: {error.strerror or error}") from None


def _warn_shortfalls(result: Any) -> None:
    """One stderr line per kind of sample an evaluation left out: undecodable images by key, lost samples by set."""
    from pretrain.eval.outcome import NAMED_KEYS, named

    if result.skipped_keys:
        more = " (all in --json)" if len(result.skipped_keys) > NAMED_KEYS else ""
        click.echo(f"warning: {len(result.skipped_keys)} undecodable image(s) left out: "
                   f"{named(result.skipped_keys)}{more}", err=True)
    for entry in result.lost:
        click.echo(entry.warning(), err=True)


def _parse_sets(items: tuple[str, ...]) -> dict[str, str]:
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--set")
        parsed[key.strip()] = value.strip()
    return parsed


def _write_json(path: Path | None, record: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n")


def _backbone(checkpoint: Path | None, random_depth: int | None, network: str, seed: int):
    """(encoder, record fields) for --checkpoint (run folder, checkpoint or exported file) or --random-init."""
    from pretrain.checkpoint import random_encoder
    from pretrain.eval.export import load_backbone

    if (checkpoint is None) == (random_depth is None):
        raise click.UsageError("give exactly one of --checkpoint or --random-init DEPTH")
    if checkpoint is not None:
        encoder, info = load_backbone(checkpoint, network=network)
        return encoder, {"checkpoint": info["checkpoint"], "random_init": None, "network": info["network"],
                         "step": info["step"], "source_format": info["format"],
                         "trained_protocol": info["trained_protocol"]}
    return random_encoder(random_depth, seed=seed), {"checkpoint": None, "random_init": random_depth,
                                                     "network": None, "step": None, "source_format": None}


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """A two-column table on stdout (the human-readable twin of --json)."""
    width = max(len(name) for name, _ in rows)
    click.echo(title)
    click.echo("-" * max(len(title), width + 14))
    for name, value in rows:
        click.echo(f"{name.ljust(width)}  {value}")


_BACKBONE_OPTIONS = [
    click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
                 help="Pretraining checkpoint, run folder (newest checkpoint) or exported encoder file."),
    click.option("--random-init", "random_depth", type=click.IntRange(min=18), default=None, metavar="DEPTH",
                 help="Instead of a checkpoint, a randomly initialised ResNet-DEPTH (the baseline)."),
    click.option("--network", type=click.Choice(["online", "target"]), default="online", show_default=True),
    click.option("--train", "train_shards", type=click.Path(path_type=Path), required=True,
                 help="Labelled shard set to train the head on."),
    click.option("--val", "val_shards", type=click.Path(path_type=Path), required=True,
                 help="Labelled shard set to score."),
    click.option("--output", type=click.Path(path_type=Path), default=None,
                 help="Folder for caches, head checkpoints (resumed on rerun) and result.json."),
    click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
                 help="Also write the result as JSON to this file."),
    click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                 help="Override one option of the preset, e.g. --set epochs=10 (repeatable)."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
    click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-init."),
]


def _backbone_options(function):
    for option in reversed(_BACKBONE_OPTIONS):
        function = option(function)
    return function


@eval_group.command("linear")
@_backbone_options
@click.option("--preset", type=click.Choice(["paper", "fast"]), default="paper", show_default=True,
              help="paper: augmented views, 100 epochs; fast: cached centre-crop features (seconds on CPU).")
@ALLOW_LOST_OPTION
def linear(checkpoint: Path | None, random_depth: int | None, network: str, train_shards: Path, val_shards: Path,
           output: Path | None, json_path: Path | None, overrides: tuple[str, ...], device: str, seed: int,
           preset: str, allow_lost: bool) -> None:
    """Linear probe of a frozen encoder: top-1 / top-5 (paper protocol or the fast cached one).

    \b
    relicv2 eval linear --checkpoint runs/r50 --train shards/train --val shards/val --preset fast
    torchrun --nproc_per_node 8 -m cli eval linear --checkpoint C --train T --val V --output out/linear
    """
    from pretrain.eval.linear import LinearConfig, config_with, evaluate_linear

    given = _parse_sets(overrides)
    try:
        config = config_with(LinearConfig.preset(preset), given)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--set") from None
    _run_evaluation(
        "relicv2 eval linear", lambda encoder, ctx, config: evaluate_linear(
            encoder, train_shards, val_shards, config, device=ctx.device, output_dir=output, ctx=ctx,
            allow_lost=allow_lost),
        config=config, given=given, checkpoint=checkpoint, random_depth=random_depth, network=network, seed=seed,
        device=device, output=output, json_path=json_path, extra={})


def _run_evaluation(job: str, evaluate: Callable[[Any, Any, Any], Any], *, config: Any, given: dict[str, str],
                    checkpoint: Path | None, random_depth: int | None, network: str, seed: int, device: str,
                    output: Path | None, json_path: Path | None, extra: dict[str, Any]) -> None:
    """The body every trained-head evaluation shares: torchrun set-up, the output folder's lock, the
    backbone, `evaluate(encoder, ctx, config)` with `config` at the image size that fits the encoder
    where `given` (the --set options) does not say, then (rank 0) the printed table and the JSON records."""
    from pretrain import distributed
    from pretrain.checkpoint import CheckpointError
    from pretrain.eval.knn import at_trained_size
    from pretrain.eval.outcome import LostSamplesError, lost_text
    from pretrain.eval.paper import HeadCheckpointError
    from pretrain.model.encoder_file import ExportError
    from shards.lock import FolderLockedError, folder_lock

    ctx = distributed.init(device)
    try:
        with folder_lock(output, job, enabled=ctx.rank == 0) if output else contextlib.nullcontext():
            encoder, record = _backbone(checkpoint, random_depth, network, seed)
            config = at_trained_size(config, record.get("trained_protocol") or {}, given)
            result = evaluate(encoder, ctx, config)
    except LostSamplesError as error:
        raise click.ClickException(f"{error}{ALLOW_LOST_HINT}") from None
    except (CheckpointError, ExportError, HeadCheckpointError, FolderLockedError, FileNotFoundError,
            ValueError) as error:
        raise click.ClickException(str(error)) from None
    finally:
        distributed.teardown(ctx)
    if ctx.rank != 0:
        return
    what = record["checkpoint"] or f"random-init ResNet-{random_depth}"
    payload = result.as_json(checkpoint=record["checkpoint"], random_init=record["random_init"],
                             extra={"network": record["network"], "step": record["step"],
                                    "world_size": ctx.world_size, "config": _plain(config), **extra})
    _print_result(f"{result.protocol} of {what}", payload, lost_text(result.lost), ctx.device)
    _warn_shortfalls(result)
    _write_json(json_path, payload)
    if output is not None:
        _write_json(output / "result.json", payload)


def _plain(config) -> dict[str, Any]:
    import dataclasses

    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def _print_result(title: str, payload: dict[str, Any], lost: str, device: object) -> None:
    top5 = payload["top5"]
    rows = [("protocol", payload["protocol"]), ("device", str(device)), ("top-1", f"{payload['top1']:.4f}"),
            ("top-5", f"{top5:.4f}" if top5 is not None else "- (fewer than 5 classes)"),
            ("train images", str(payload["num_train"])), ("val images", str(payload["num_val"])),
            ("undecodable skipped", str(payload["skipped"])), ("lost while reading", lost)]
    print_table(title, rows)



@eval_group.command("finetune")
@_backbone_options
@click.option("--labels", "labels_path", type=click.Path(path_type=Path), required=True,
              help="Key list of the labelled subset (relicv2 shards subset ... --out KEYS.txt).")
@click.option("--preset", type=click.Choice(["1pct", "10pct"]), default="1pct", show_default=True,
              help="The paper's 1% or 10% recipe (batch, head / encoder lr, weight decay).")
def finetune_command(checkpoint: Path | None, random_depth: int | None, network: str, train_shards: Path,
                     val_shards: Path, output: Path | None, json_path: Path | None, overrides: tuple[str, ...],
                     device: str, seed: int, labels_path: Path, preset: str) -> None:
    """Semi-supervised fine-tuning: encoder + new linear head on a labelled key subset, 20 epochs.

    \b
    relicv2 shards subset shards/train --fraction 0.01 --out 1pct.txt
    relicv2 eval finetune --checkpoint runs/r50 --train shards/train --val shards/val --labels 1pct.txt
    """
    from pretrain.eval.finetune import FinetuneConfig, finetune
    from pretrain.eval.linear import config_with
    from shards.subset import read_key_list

    given = _parse_sets(overrides)
    try:
        config = config_with(FinetuneConfig.preset_config(preset), given)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--set") from None
    try:
        keys = read_key_list(labels_path)
    except (FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    _run_evaluation(
        "relicv2 eval finetune", lambda encoder, ctx, config: finetune(
            encoder, train_shards, val_shards, keys, config, device=ctx.device, output_dir=output, ctx=ctx),
        config=config, given=given, checkpoint=checkpoint, random_depth=random_depth, network=network, seed=seed,
        device=device, output=output, json_path=json_path, extra={"labels": str(labels_path)})

"""`relicv2 eval ...` commands."""

from __future__ import annotations

from pathlib import Path

import click

from pretrain.config import KnnConfig  # light (no torch): the one owner of the kNN defaults

KNN = KnnConfig()


@click.group()
def eval_group() -> None:
    """Evaluate pretrained encoders (kNN)."""


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
def knn(checkpoint: Path | None, random_depth: int | None, network: str, train_shards: Path, val_shards: Path,
        k: int | None, temperature: float | None, crop_size: int | None, resize_size: int | None,
        batch_size: int | None, device: str, seed: int, json_path: Path | None) -> None:
    """Weighted cosine kNN top-1 of an encoder: train features as the bank (defaults: pretrain.config.KnnConfig)."""
    import dataclasses
    import json

    import torch

    from pretrain.checkpoint import CheckpointError
    from pretrain.config import ConfigError, load_config
    from pretrain.eval.knn import (
        encoder_from_checkpoint,
        evaluate_knn,
        random_encoder,
        resolve_checkpoint,
    )
    from shards.atomic import atomic_write_bytes

    if (checkpoint is None) == (random_depth is None):
        raise click.UsageError("give exactly one of --checkpoint or --random-init DEPTH")
    given = {"k": k, "temperature": temperature, "crop_size": crop_size, "resize_size": resize_size,
             "batch_size": batch_size}
    try:  # the kNN settings are checked (positive, finite) by the one dataclass that owns their defaults
        settings = load_config(None, [f"knn.{name}={value}" for name, value in given.items() if value is not None]).knn
    except ConfigError as error:
        raise click.UsageError(str(error).replace("--set overrides: knn.", "--").replace("_", "-")) from None
    for name, folder in (("--train", train_shards), ("--val", val_shards)):
        if not folder.exists():
            raise click.UsageError(f"{name} {folder} does not exist; pass a labelled shard set folder")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda but no CUDA device is visible; use --device cpu")
    try:
        if checkpoint is not None:
            checkpoint = resolve_checkpoint(checkpoint)
            encoder, what = encoder_from_checkpoint(checkpoint, network=network), f"{checkpoint} ({network})"
        else:
            encoder, what = random_encoder(random_depth, seed=seed), f"random-init ResNet-{random_depth}"
        result = evaluate_knn(encoder.to(device), train_shards, val_shards, settings=settings, device=device,
                              progress=True)
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    assert result is not None  # a single process is rank 0
    click.echo(f"{what}: kNN top-1 {result.top1:.4f} (k={settings.k}, T={settings.temperature}; "
               f"{result.num_train} train, {result.num_val} val, {result.skipped} undecodable skipped)")
    if json_path is not None:
        record = {"protocol": "knn", "checkpoint": str(checkpoint) if checkpoint is not None else None,
                  "random_init": random_depth, "top1": result.top1, "top5": None,
                  "num_train": result.num_train, "num_val": result.num_val, "skipped": result.skipped,
                  "network": network if checkpoint is not None else None,
                  "settings": {key: value for key, value in dataclasses.asdict(settings).items()
                               if key in given}}
        try:
            atomic_write_bytes(json_path, (json.dumps(record, indent=2) + "\n").encode())
        except OSError as error:
            raise click.ClickException(f"cannot write --json {json_path}: {error.strerror or error}") from None

"""`relicv2 eval ...` commands."""

from __future__ import annotations

from pathlib import Path

import click


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
@click.option("--k", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--temperature", type=float, default=0.07, show_default=True)
@click.option("--crop-size", type=click.IntRange(min=8), default=224, show_default=True)
@click.option("--resize-size", type=click.IntRange(min=0), default=0,
              help="Short side before the centre crop; 0 means crop-size / 0.875 (256 for 224).")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-init.")
def knn(checkpoint: Path | None, random_depth: int | None, network: str, train_shards: Path, val_shards: Path,
        k: int, temperature: float, crop_size: int, resize_size: int, batch_size: int, device: str,
        seed: int) -> None:
    """Weighted cosine kNN top-1 (k = 20, T = 0.07) of an encoder: train features as the bank."""
    import torch

    from pretrain.checkpoint import CheckpointError
    from pretrain.eval.knn import (
        encoder_from_checkpoint,
        evaluate_knn,
        random_encoder,
        resolve_checkpoint,
    )

    if (checkpoint is None) == (random_depth is None):
        raise click.UsageError("give exactly one of --checkpoint or --random-init DEPTH")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if checkpoint is not None:
            checkpoint = resolve_checkpoint(checkpoint)
            encoder, what = encoder_from_checkpoint(checkpoint, network=network), f"{checkpoint} ({network})"
        else:
            encoder, what = random_encoder(random_depth, seed=seed), f"random-init ResNet-{random_depth}"
        result = evaluate_knn(encoder.to(device), train_shards, val_shards, k=k, temperature=temperature,
                              crop_size=crop_size, resize_size=resize_size, batch_size=batch_size, device=device)
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{what}: kNN top-1 {result.top1:.4f} (k={k}, T={temperature}; {result.num_train} train, "
               f"{result.num_val} val, {result.skipped} undecodable skipped)")

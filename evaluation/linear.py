"""Linear evaluation of a frozen encoder (paper appendix "Linear evaluation"), two named protocols:
- "linear-paper" (`evaluation.paper`): a linear head on the frozen encoder (BN in eval mode) trained
  on augmented views, checkpointed every epoch and resumed by a rerun;
- "linear-fast": the same optimiser on features taken once on the test view and cached on disk
  (`evaluation.features`), standardised with the train set's mean/std first (a BN without affine
  parameters folded into the head), so one learning rate suits any encoder. Seconds on a CPU.

Under torchrun every rank extracts or augments 1/W of the images; the fast head is trained identically
on every rank, the paper head with gradients averaged over ranks; correct predictions are summed exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from relicv2.evaluation import supervised
from relicv2.evaluation.features import FeatureSet, FeatureSpec, cached_features
from relicv2.evaluation.linear_config import LinearConfig
from relicv2.evaluation.paper import train_linear_paper
from relicv2.evaluation.supervised import Batches, LinearResult, accuracy_report, train_classifier
from relicv2.pretrain.distributed import DistributedContext, open_shard_sets
from relicv2.pretrain.knn.classes import check_same_classes
from relicv2.shards.shardset import Spec


def train_linear_on_features(
    train: FeatureSet,
    val: FeatureSet,
    config: LinearConfig,
    *,
    num_classes: int,
    device: str | torch.device = "cpu",
) -> LinearResult:
    """The `fast` protocol's head, trained on `device` (each batch goes there as it is drawn); deterministic
    for a given seed, so every rank of a distributed run trains the same head."""
    if len(train) == 0 or len(val) == 0:
        raise ValueError("linear evaluation needs labelled train and val features")
    generator = torch.Generator().manual_seed(config.seed)
    mean = train.features.mean(dim=0).to(device)
    std = train.features.std(dim=0).clamp_min(1e-6).to(device)

    def standardised(rows: torch.Tensor) -> torch.Tensor:
        # A batch at a time: standardising the whole bank would hold it three times at once (two more
        # 10 GiB temporaries at ImageNet's 1.28 M x 2048).
        return (rows.to(device) - mean) / std

    # Initialised on the CPU: the same draws on any device.
    head = supervised.new_head(train.features.shape[1], num_classes, generator).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=config.peak_lr, momentum=config.momentum,
                                nesterov=config.nesterov, weight_decay=config.weight_decay)
    batch = min(config.batch_size, len(train))
    steps_per_epoch = math.ceil(len(train) / batch)

    def train_batches(epoch: int) -> Batches:
        order = torch.randperm(len(train), generator=generator)
        return ((standardised(train.features[index]), train.labels[index], []) for index in order.split(batch))

    train_classifier(head, head, optimizer, train_batches=train_batches, epochs=config.epochs,
                     learning_rates=config.learning_rates(steps_per_epoch * config.epochs),
                     steps_per_epoch=steps_per_epoch, skipped=set())
    with torch.no_grad():
        logits = torch.cat([head(standardised(rows)).cpu() for rows in val.features.split(65_536)])
    top1, top5, per_class = accuracy_report(logits, val.labels, num_classes)
    return LinearResult(config.name, top1, top5, len(train), len(val), train.skipped + val.skipped,
                        per_class, config.epochs, sorted(train.skipped_keys + val.skipped_keys),
                        [*train.lost, *val.lost])


def evaluate_linear(
    encoder: nn.Module,
    train_shards: Spec,
    val_shards: Spec,
    config: LinearConfig,
    *,
    device: str | torch.device = "cpu",
    output_dir: str | Path | None = None,
    ctx: DistributedContext | None = None,
    allow_lost: bool = False,
) -> LinearResult:
    """Linear top-1/top-5 of a frozen `encoder` on `val_shards` after training a head on `train_shards`.

    `output_dir` holds the feature cache (fast) or the head's checkpoints (paper); None keeps nothing.
    Sets whose class names differ are refused first (ClassMismatchError). The fast protocol reads the
    tars itself (a set that loses samples raises LostSamplesError unless `allow_lost`); the paper
    protocol resolves each set through its index, which refuses a damaged set (ShardSetError).
    """
    train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards, check_samples=False,
                                               allow_lost=config.protocol == "fast")
    check_same_classes(train_shards, val_shards)
    encoder = encoder.to(device).eval().requires_grad_(False)
    if config.protocol == "fast":
        spec = FeatureSpec(crop_size=config.crop_size, resize_size=config.resize_size,
                           batch_size=config.feature_batch)
        cache = Path(output_dir) / "features" if output_dir is not None else None
        train, val = (cached_features(encoder, shards, spec, cache_dir=cache, device=device, ctx=ctx,
                                      allow_lost=allow_lost) for shards in (train_shards, val_shards))
        num_classes = int(max(train.labels.max(), val.labels.max())) + 1
        return train_linear_on_features(train, val, config, num_classes=num_classes, device=device)
    return train_linear_paper(encoder, train_shards, val_shards, config, device=torch.device(device),
                              output_dir=Path(output_dir) if output_dir is not None else None, ctx=ctx)

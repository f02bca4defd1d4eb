"""The paper's linear protocol: augmented views through a frozen encoder, head checkpointed each epoch.

See `evaluation.linear` for the recipe and `evaluation.supervised` for the loop. The head's state
file `linear-head.pt` in the output folder holds {format, epoch, config, head, optimizer}.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from relicv2.evaluation import supervised
from relicv2.evaluation.linear_config import LinearConfig
from relicv2.evaluation.views import LabelledViews, class_count, epoch_batches, labelled_samples
from relicv2.pretrain.distributed import DistributedContext, open_shard_sets
from relicv2.shards.shardset import Spec

HEAD_FORMAT = "relicv2-linear-head"
HEAD_FILE = "linear-head.pt"


def train_linear_paper(
    encoder: nn.Module, train_shards: Spec, val_shards: Spec, config: LinearConfig, *,
    device: torch.device, output_dir: Path | None, ctx: DistributedContext | None = None,
) -> supervised.LinearResult:
    """Train the head on augmented views of `train_shards`, score it on `val_shards` (exact over ranks); each a
    spec or the job's resolved `ShardSet`, opened once here for the views' decoding."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    per_rank_batch = max(1, config.batch_size // world)
    if config.backend == "dali":
        from relicv2.evaluation.dali_views import DECODE, DaliViews

        train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards, **DECODE)
        common = {"crop_size": config.crop_size, "resize_size": config.resize_size, "batch_size": per_rank_batch,
                  "rank": rank, "world": world, "threads": config.workers, "device": device}
        dali = {True: DaliViews(train_shards, train=True, scale=config.crop_scale, seed=config.seed, **common),
                False: DaliViews(val_shards, train=False, **common)}  # by LabelledViews.train
        train_samples, val_samples = dali[True].sample_set.samples, dali[False].sample_set.samples
        train_skipped, val_skipped = set(dali[True].sample_set.skipped_keys), set(dali[False].sample_set.skipped_keys)
    else:
        train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards)
        train_samples, train_skipped = labelled_samples(train_shards)
        val_samples, val_skipped = labelled_samples(val_shards)
    train_set = LabelledViews(train_samples, train=True, crop_size=config.crop_size,
                              resize_size=config.resize_size, scale=config.crop_scale, seed=config.seed)
    val_set = LabelledViews(val_samples, train=False, crop_size=config.crop_size, resize_size=config.resize_size)

    def batches(views: LabelledViews, epoch: int) -> supervised.Batches:
        if config.backend == "dali":
            return dali[views.train].epoch()
        return epoch_batches(views, epoch, rank=rank, world=world, batch_size=per_rank_batch,
                             workers=config.workers)

    num_classes = class_count((train_samples, train_shards), (val_samples, val_shards))
    torch.manual_seed(config.seed)
    head = supervised.new_head(encoder.num_features, num_classes).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=config.peak_lr, momentum=config.momentum,
                                nesterov=config.nesterov, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / per_rank_batch)
    state = (supervised.StateFile(output_dir / HEAD_FILE, HEAD_FORMAT, config, ("workers", "feature_batch"),
                                  what="linear", network="head") if output_dir is not None else None)

    def forward(images: Tensor) -> Tensor:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = encoder(images.to(device, non_blocking=True)).float()
        return head(features)

    supervised.train_classifier(
        head, forward, optimizer, train_batches=lambda epoch: batches(train_set, epoch),
        learning_rates=config.learning_rates(steps_per_epoch * config.epochs),
        epochs=config.epochs, steps_per_epoch=steps_per_epoch, skipped=train_skipped, state=state, ctx=ctx,
        desc="linear")
    return supervised.score(head, forward, batches(val_set, 0), protocol=config.name, num_classes=num_classes,
                            num_train=len(train_set), epochs=config.epochs, train_skipped=train_skipped,
                            val_skipped=val_skipped, ctx=ctx)

"""Semi-supervised fine-tuning on a labelled subset (paper appendix "Semi-supervised learning").

The pretrained encoder plus a new linear head are trained together on the keys of a label split
(`relicv2 shards subset`, 1% or 10% of each class) with SGD (Nesterov), both learning rates
multiplied by `decay` at the milestone epochs; the presets (`evaluation/presets/finetune/`) hold
the paper's recipe for each split, and another batch scales both lrs linearly. Scored on the test
view. The state is checkpointed each epoch to `finetune.pt` and a rerun resumes from it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from relicv2.evaluation import supervised
from relicv2.evaluation.views import LabelledViews, class_count, epoch_batches, labelled_samples
from relicv2.pretrain.distributed import DistributedContext, open_shard_sets
from relicv2.pretrain.knn.classes import check_same_classes
from relicv2.pretrain.schedules import peak_learning_rate, step_decay
from relicv2.pretrain.views.config import FULL_CROP_SCALE, IMAGE_SIZE, check_crop_scale, resize_of
from relicv2.shards.reader import SampleRef

STATE_FORMAT = "relicv2-finetune"
STATE_FILE = "finetune.pt"


@dataclass(frozen=True)
class FinetuneConfig:
    preset: str = "1pct"  # the preset's name (or the YAML file's stem) the settings came from
    epochs: int = 20
    milestones: tuple[float, float] = (12, 16)  # epochs at which both lrs are multiplied by `decay`
    decay: float = 0.2
    batch_size: int = 2048
    head_lr: float = 10.0  # at `reference_batch`; scaled linearly with batch_size
    encoder_lr: float = 0.04
    reference_batch: int = 2048
    weight_decay: float = 0.0
    momentum: float = 0.9
    crop_size: int = IMAGE_SIZE
    resize_size: int = resize_of(IMAGE_SIZE)  # test views: short side before the centre crop; 0: crop_size / 0.875
    crop_scale: tuple[float, float] = FULL_CROP_SCALE
    seed: int = 0
    workers: int = 2

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.crop_size < 8:
            raise ValueError("epochs, batch_size must be positive and crop_size at least 8")
        if self.head_lr <= 0 or self.encoder_lr < 0 or not 0 < self.decay <= 1:
            raise ValueError("head_lr must be > 0, encoder_lr >= 0 and decay in (0, 1]")
        if self.reference_batch < 1 or self.weight_decay < 0 or not 0 <= self.momentum < 1 or self.workers < 0:
            raise ValueError("reference_batch must be positive, weight_decay >= 0, momentum in [0, 1) and workers "
                             ">= 0")
        check_crop_scale("crop_scale", self.crop_scale)

    @property
    def protocol(self) -> str:
        return f"finetune-{self.preset}"


def learning_rates(config: FinetuneConfig, steps_per_epoch: int) -> Callable[[int], list[float]]:
    """(head lr, encoder lr) at a global step: scaled with the batch, times `decay` at each milestone epoch."""
    milestones = [math.ceil(epoch) * steps_per_epoch for epoch in config.milestones]
    peaks = [peak_learning_rate(lr, config.batch_size, config.reference_batch)
             for lr in (config.head_lr, config.encoder_lr)]
    return lambda step: [step_decay(step, peak_lr=peak, milestones=milestones, decay=config.decay) for peak in peaks]


def finetune(
    encoder: nn.Module, train_shards: str | Path, val_shards: str | Path, keys: set[str], config: FinetuneConfig, *,
    device: str | torch.device = "cpu", output_dir: str | Path | None = None, ctx: DistributedContext | None = None,
) -> supervised.LinearResult:
    """Fine-tune `encoder` + a new head on the `keys` of `train_shards`; top-1/top-5 on `val_shards`.

    Each set is resolved here, once (a resolved `shards.ShardSet` is taken as it is); sets whose
    recorded class names differ are refused before any training (ClassMismatchError)."""
    train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards)
    check_same_classes(train_shards, val_shards)
    train_samples, train_skipped = labelled_samples(train_shards, keys)
    val_samples, val_skipped = labelled_samples(val_shards)
    num_classes = class_count((train_samples, train_shards), (val_samples, val_shards))
    state = Path(output_dir) / STATE_FILE if output_dir is not None else None
    return finetune_samples(encoder, (train_samples, train_skipped), (val_samples, val_skipped), num_classes,
                            config, device=device, state_path=state, ctx=ctx)


def finetune_samples(
    encoder: nn.Module, train: tuple[Sequence[SampleRef], set[str]], val: tuple[Sequence[SampleRef], set[str]],
    num_classes: int, config: FinetuneConfig, *, device: str | torch.device = "cpu", state_path: Path | None = None,
    ctx: DistributedContext | None = None,
) -> supervised.LinearResult:
    """Fine-tune `encoder` + a new head of `num_classes` on the `train` samples (with the keys already left
    out as broken), score on the `val` samples; the state is kept in `state_path` every epoch (resumed)."""
    (train_samples, train_skipped), (val_samples, val_skipped) = train, val
    train_skipped, val_skipped = set(train_skipped), set(val_skipped)  # training adds the undecodable keys
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    train_set = LabelledViews(train_samples, train=True, crop_size=config.crop_size,
                              resize_size=config.resize_size, scale=config.crop_scale, seed=config.seed)
    val_set = LabelledViews(val_samples, train=False, crop_size=config.crop_size, resize_size=config.resize_size)
    torch.manual_seed(config.seed)
    head = supervised.new_head(encoder.num_features, num_classes)
    model = nn.Sequential(OrderedDict(encoder=encoder, head=head)).to(device)
    # The lrs set here are overwritten from the schedule at every step.
    optimizer = torch.optim.SGD([{"params": model.head.parameters()}, {"params": model.encoder.parameters()}],
                                lr=config.head_lr, momentum=config.momentum, nesterov=True,
                                weight_decay=config.weight_decay)
    per_rank_batch = max(1, config.batch_size // world)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / per_rank_batch)
    state = (supervised.StateFile(state_path, STATE_FORMAT, config, ("workers",), what="fine-tuning",
                                  network="model", inputs=supervised.trained_on(encoder, train_samples))
             if state_path is not None else None)

    batches = partial(epoch_batches, rank=rank, world=world, batch_size=per_rank_batch, workers=config.workers)

    def forward(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(device))

    supervised.train_classifier(
        model, forward, optimizer, learning_rates=learning_rates(config, steps_per_epoch),
        train_batches=lambda epoch: batches(train_set, epoch), epochs=config.epochs, steps_per_epoch=steps_per_epoch,
        skipped=train_skipped, min_batch=2, state=state, ctx=ctx, desc=config.protocol)
    return supervised.score(model, forward, batches(val_set, 0), protocol=config.protocol, num_classes=num_classes,
                            num_train=len(train_set), epochs=config.epochs, train_skipped=train_skipped,
                            val_skipped=val_skipped, ctx=ctx)

"""Linear evaluation of a frozen encoder (paper appendix "Linear evaluation"), two named protocols
(presets `paper` and `fast` in `evaluation/presets/linear/`):
- "linear-paper": a linear head on the frozen encoder (BN in eval mode) trained on augmented views,
  its state checkpointed every epoch to `linear-head.pt` and resumed by a rerun;
- "linear-fast": the same optimiser on features taken once on the test view and cached on disk
  (`evaluation.features`), standardised with the train set's mean/std first (a BN without affine
  parameters folded into the head), so one learning rate suits any encoder. Seconds on a CPU.

Both save the trained head as a head file (`evaluation.head_file`) in the output folder, for scoring other
sets with no training (`relicv2 eval robustness`).

Under torchrun every rank extracts or augments 1/W of the images; the fast head is trained identically
on every rank, the paper head with gradients averaged over ranks; correct predictions are summed exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from relicv2.evaluation import supervised
from relicv2.evaluation.features import FeatureSet, FeatureSpec, cached_features
from relicv2.evaluation.head_file import TRAINED_HEAD_FILE, save_head
from relicv2.evaluation.supervised import Batches, LinearResult, accuracy_report, train_classifier
from relicv2.evaluation.views import LabelledViews, class_count, epoch_batches, labelled_samples
from relicv2.pretrain.distributed import DistributedContext, open_shard_sets
from relicv2.pretrain.knn import classes
from relicv2.pretrain.knn.classes import check_same_classes, class_names
from relicv2.pretrain.schedules import learning_rate, peak_learning_rate
from relicv2.pretrain.views.config import FULL_CROP_SCALE, IMAGE_SIZE, check_crop_scale, resize_of
from relicv2.shards.shardset import Spec

PROTOCOLS = ("paper", "fast")
HEAD_FORMAT = "relicv2-linear-head"
HEAD_FILE = "linear-head.pt"


@dataclass(frozen=True)
class LinearConfig:
    """Options of the linear probe (presets `paper` and `fast` in `evaluation/presets/linear/`)."""

    protocol: str = "paper"
    epochs: int = 100
    batch_size: int = 1024  # global, over all ranks
    base_lr: float = 0.3  # peak lr = base_lr * batch_size / 256
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0
    crop_size: int = IMAGE_SIZE
    resize_size: int = resize_of(IMAGE_SIZE)  # test views: short side before the centre crop; 0: crop_size / 0.875
    crop_scale: tuple[float, float] = FULL_CROP_SCALE  # train views (paper protocol)
    seed: int = 0
    workers: int = 2  # decoding workers / DALI threads (paper protocol)
    backend: str = "dali"  # paper protocol views: "dali" (CPU or GPU decoding) or "pil" (torch DataLoader)
    feature_batch: int = 256  # images per forward pass of the frozen encoder

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"linear protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        for name in ("epochs", "batch_size", "crop_size", "feature_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear.{name} must be positive, got {getattr(self, name)}")
        if self.base_lr <= 0 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError("linear.base_lr must be > 0, momentum in [0, 1) and weight_decay >= 0")
        if self.backend not in ("dali", "pil"):
            raise ValueError(f"linear.backend must be 'dali' or 'pil', got {self.backend!r}")
        check_crop_scale("linear.crop_scale", self.crop_scale)

    @property
    def name(self) -> str:
        return f"linear-{self.protocol}"

    @property
    def peak_lr(self) -> float:
        return peak_learning_rate(self.base_lr, self.batch_size)

    def learning_rates(self, total_steps: int) -> Callable[[int], list[float]]:
        """The head's lr at a global step: cosine from `peak_lr` over `total_steps`, no warm-up."""
        return lambda step: [learning_rate(step, peak_lr=self.peak_lr, warmup_steps=0, total_steps=total_steps)]

    def optimizer(self, head: nn.Module) -> torch.optim.SGD:
        """The head's SGD (the schedule sets its lr at every step)."""
        return torch.optim.SGD(head.parameters(), lr=self.peak_lr, momentum=self.momentum, nesterov=self.nesterov,
                               weight_decay=self.weight_decay)


def train_linear_on_features(
    train: FeatureSet,
    val: FeatureSet,
    config: LinearConfig,
    *,
    num_classes: int,
    device: str | torch.device = "cpu",
    keep: Callable[..., object] | None = None,
) -> LinearResult:
    """The `fast` protocol's head, trained on `device` (each batch goes there as it is drawn); deterministic
    for a given seed, so every rank of a distributed run trains the same head. `keep(head, mean=, std=)`
    receives it trained (to save it as a head file)."""
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
    batch = min(config.batch_size, len(train))
    steps_per_epoch = math.ceil(len(train) / batch)

    def train_batches(epoch: int) -> Batches:
        order = torch.randperm(len(train), generator=generator)
        return ((standardised(train.features[index]), train.labels[index], []) for index in order.split(batch))

    train_classifier(head, head, config.optimizer(head), train_batches=train_batches, epochs=config.epochs,
                     learning_rates=config.learning_rates(steps_per_epoch * config.epochs),
                     steps_per_epoch=steps_per_epoch, skipped=set())
    if keep is not None:
        keep(head, mean=mean, std=std)
    with torch.no_grad():
        logits = torch.cat([head(standardised(rows)).cpu() for rows in val.features.split(65_536)])
    top1, top5, per_class = accuracy_report(logits, val.labels, num_classes)
    return LinearResult(config.name, top1, top5, len(train), len(val), train.skipped + val.skipped,
                        per_class, config.epochs, sorted(train.skipped_keys + val.skipped_keys),
                        [*train.lost, *val.lost])


def train_linear_paper(
    encoder: nn.Module, train_shards: Spec, val_shards: Spec, config: LinearConfig, *,
    device: torch.device, output_dir: Path | None, ctx: DistributedContext | None = None,
    keep: Callable[..., object] | None = None,
) -> LinearResult:
    """The `paper` protocol: train the head on augmented views of `train_shards`, score it on `val_shards`
    (exact over ranks); each a spec or the job's resolved `ShardSet`, opened once here for the views' decoding."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    per_rank_batch = max(1, config.batch_size // world)
    if config.backend == "dali":
        from relicv2.evaluation.dali_views import DECODE, DaliViews, eval_sample_set

        train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards, **DECODE)
        sets = {True: eval_sample_set(train_shards), False: eval_sample_set(val_shards)}  # by LabelledViews.train
        train_samples, val_samples = sets[True].samples, sets[False].samples
        train_skipped, val_skipped = set(sets[True].skipped_keys), set(sets[False].skipped_keys)
    else:
        train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards)
        train_samples, train_skipped = labelled_samples(train_shards)
        val_samples, val_skipped = labelled_samples(val_shards)
    train_set = LabelledViews(train_samples, train=True, crop_size=config.crop_size,
                              resize_size=config.resize_size, scale=config.crop_scale, seed=config.seed)
    val_set = LabelledViews(val_samples, train=False, crop_size=config.crop_size, resize_size=config.resize_size)

    def batches(views: LabelledViews, epoch: int) -> Batches:
        if config.backend == "dali":
            return dali[views.train].epoch()
        return epoch_batches(views, epoch, rank=rank, world=world, batch_size=per_rank_batch,
                             workers=config.workers)

    # Before any DALI pipeline: one would stop on a label it cannot batch (a `cls` member of 5,000 digits).
    num_classes = class_count((train_samples, train_shards), (val_samples, val_shards))
    if config.backend == "dali":
        common = {"crop_size": config.crop_size, "resize_size": config.resize_size, "batch_size": per_rank_batch,
                  "rank": rank, "world": world, "threads": config.workers, "device": device}
        dali = {True: DaliViews(sets[True], train=True, scale=config.crop_scale, seed=config.seed, **common),
                False: DaliViews(sets[False], train=False, **common)}
    torch.manual_seed(config.seed)
    head = supervised.new_head(encoder.num_features, num_classes).to(device)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / per_rank_batch)
    state = (supervised.StateFile(output_dir / HEAD_FILE, HEAD_FORMAT, config, ("workers", "feature_batch"),
                                  what="linear", network="head", inputs=supervised.trained_on(encoder, train_samples))
             if output_dir is not None else None)

    def forward(images: Tensor) -> Tensor:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = encoder(images.to(device, non_blocking=True)).float()
        return head(features)

    train_classifier(
        head, forward, config.optimizer(head), train_batches=lambda epoch: batches(train_set, epoch),
        learning_rates=config.learning_rates(steps_per_epoch * config.epochs),
        epochs=config.epochs, steps_per_epoch=steps_per_epoch, skipped=train_skipped, state=state, ctx=ctx,
        desc="linear")
    if keep is not None:
        keep(head, mean=None, std=None)  # the paper's head takes the frozen encoder's features as they are
    return supervised.score(head, forward, batches(val_set, 0), protocol=config.name, num_classes=num_classes,
                            num_train=len(train_set), epochs=config.epochs, train_skipped=train_skipped,
                            val_skipped=val_skipped, ctx=ctx)


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
    With `output_dir`, rank 0 also saves the trained head as a head file (`head_file.TRAINED_HEAD_FILE`).
    Sets whose class names differ are refused first (ClassMismatchError). The fast protocol reads the
    tars itself (a set that loses samples raises LostSamplesError unless `allow_lost`); the paper
    protocol resolves each set through its index, which refuses a damaged set (ShardSetError).
    """
    train_shards, val_shards = open_shard_sets(ctx, train_shards, val_shards, check_samples=False,
                                               allow_lost=config.protocol == "fast")
    check_same_classes(train_shards, val_shards)
    encoder = encoder.to(device).eval().requires_grad_(False)
    keep = None
    if output_dir is not None and (ctx is None or ctx.rank == 0):
        keep = functools.partial(save_head, Path(output_dir) / TRAINED_HEAD_FILE, encoder=encoder,
                                 classes=class_names(train_shards), crop_size=config.crop_size,
                                 resize_size=config.resize_size, protocol=config.name)
    if config.protocol == "fast":
        spec = FeatureSpec(crop_size=config.crop_size, resize_size=config.resize_size,
                           batch_size=config.feature_batch)
        cache = Path(output_dir) / "features" if output_dir is not None else None
        train, val = (cached_features(encoder, shards, spec, cache_dir=cache, device=device, ctx=ctx,
                                      allow_lost=allow_lost) for shards in (train_shards, val_shards))
        num_classes = classes.class_count((train_shards, train.labels), (val_shards, val.labels))
        return train_linear_on_features(train, val, config, num_classes=num_classes, device=device, keep=keep)
    return train_linear_paper(encoder, train_shards, val_shards, config, device=torch.device(device),
                              output_dir=Path(output_dir) if output_dir is not None else None, ctx=ctx, keep=keep)

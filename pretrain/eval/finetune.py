"""Semi-supervised fine-tuning on a labelled subset (paper appendix "Semi-supervised learning").

The pretrained encoder plus a new randomly initialised linear head are trained together on the
keys of a label split (`relicv2 shards subset`, 1% or 10% of each class): random-resized-crop +
flip views, cross-entropy, SGD with Nesterov momentum 0.9, 20 epochs, both learning rates
multiplied by 0.2 at epochs 12 and 16, a separate learning rate for the head and the encoder.
Presets (`pretrain/eval/presets/finetune/`; the paper's values at the paper's batch, another batch
scales both lrs linearly):
    1pct:  batch 2048, head lr 10,  encoder lr 0.04,  no weight decay (the defaults)
    10pct: batch 512,  head lr 0.3, encoder lr 0.004, weight decay 1e-5
Scored on the test view (short side 256 bicubic, centre crop 224). The state (encoder, head,
optimiser, epoch) is checkpointed each epoch to `finetune.pt` and a rerun resumes from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pretrain.distributed import DistributedContext, all_gather_object, prepare_shard_sets
from pretrain.eval.classes import check_same_classes
from pretrain.eval.linear import LinearResult, accuracy_report
from pretrain.eval.paper import HeadCheckpointError, _average_gradients
from pretrain.eval.views import LabelledViews, class_count, labelled_samples, loader, rank_order
from pretrain.untrusted import TORCH_LOAD_ERRORS
from shards.atomic import atomic_output

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
    crop_size: int = 224
    resize_size: int = 256
    crop_scale: tuple[float, float] = (0.08, 1.0)
    seed: int = 0
    workers: int = 2

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.crop_size < 8:
            raise ValueError("epochs, batch_size must be positive and crop_size at least 8")
        if self.head_lr <= 0 or self.encoder_lr < 0 or not 0 < self.decay <= 1:
            raise ValueError("head_lr must be > 0, encoder_lr >= 0 and decay in (0, 1]")

    @property
    def protocol(self) -> str:
        return f"finetune-{self.preset}"

    def lr_factor(self, epoch: int) -> float:
        """Batch scaling times the step decay at the milestones."""
        passed = sum(epoch >= milestone for milestone in self.milestones)
        return self.batch_size / self.reference_batch * self.decay ** passed


def _config_dict(config: FinetuneConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()
            if k != "workers"}


class _Classifier(nn.Module):
    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.num_features, num_classes)
        nn.init.normal_(self.head.weight, 0, 0.01)
        nn.init.zeros_(self.head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(images))


def _load_state(path: Path, config: FinetuneConfig) -> dict | None:
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except TORCH_LOAD_ERRORS as error:
        raise HeadCheckpointError(f"{path} is unreadable ({type(error).__name__}); delete it to start over") from None
    if not isinstance(payload, dict) or payload.get("format") != STATE_FORMAT:
        raise HeadCheckpointError(f"{path} is not a fine-tuning checkpoint; use another --output folder")
    if payload["config"] != _config_dict(config):
        raise HeadCheckpointError(f"{path} was written with other fine-tuning options; use another --output "
                                  "folder or the same options")
    return payload


def finetune(
    encoder: nn.Module,
    train_shards: str | Path,
    val_shards: str | Path,
    keys: set[str],
    config: FinetuneConfig,
    *,
    device: str | torch.device = "cpu",
    output_dir: str | Path | None = None,
    ctx: DistributedContext | None = None,
) -> LinearResult:
    """Fine-tune `encoder` + a new head on the `keys` of `train_shards`; top-1/top-5 on `val_shards`.

    Sets whose recorded class names differ are refused first (ClassMismatchError)."""
    check_same_classes(train_shards, val_shards)
    device = torch.device(device)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    prepare_shard_sets(ctx, train_shards, val_shards)
    train_left_out: list[str] = []
    val_left_out: list[str] = []
    train_samples, _ = labelled_samples(train_shards, keys, left_out=train_left_out)
    val_samples, _ = labelled_samples(val_shards, left_out=val_left_out)
    train_skipped, val_skipped = set(train_left_out), set(val_left_out)
    train_set = LabelledViews(train_samples, train=True, crop_size=config.crop_size,
                              resize_size=config.resize_size, scale=config.crop_scale, seed=config.seed)
    val_set = LabelledViews(val_samples, train=False, crop_size=config.crop_size, resize_size=config.resize_size)
    num_classes = class_count((train_samples, train_shards), (val_samples, val_shards))
    torch.manual_seed(config.seed)
    model = _Classifier(encoder, num_classes).to(device)
    head_lr = config.head_lr
    encoder_lr = config.encoder_lr
    optimizer = torch.optim.SGD([{"params": model.head.parameters(), "lr": head_lr, "base": head_lr},
                                 {"params": model.encoder.parameters(), "lr": encoder_lr, "base": encoder_lr}],
                                momentum=config.momentum, nesterov=True, weight_decay=config.weight_decay)
    per_rank_batch = max(1, config.batch_size // world)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / per_rank_batch)
    path = Path(output_dir) / STATE_FILE if output_dir is not None else None
    start_epoch = 0
    if path is not None and (saved := _load_state(path, config)) is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = int(saved["epoch"])
    progress = tqdm(total=steps_per_epoch * config.epochs, initial=start_epoch * steps_per_epoch,
                    desc=config.protocol, disable=rank != 0, unit="step")
    for epoch in range(start_epoch, config.epochs):
        model.train()
        train_set.epoch = epoch
        for group in optimizer.param_groups:
            group["lr"] = group["base"] * config.lr_factor(epoch)
        order = rank_order(len(train_set), seed=config.seed, epoch=epoch, rank=rank, world=world, shuffle=True)
        for images, labels, bad in loader(train_set, order, per_rank_batch, config.workers):
            train_skipped.update(bad)  # a set: an undecodable image is met once per epoch, counted once
            if labels.numel() > 1:  # BatchNorm in train mode needs more than one image
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            else:
                loss = sum(p.sum() for p in model.parameters()) * 0.0
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _average_gradients(model, ctx)
            optimizer.step()
            progress.update(1)
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
        if path is not None and rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(path) as tmp:
                torch.save({"format": STATE_FORMAT, "epoch": epoch + 1, "config": _config_dict(config),
                            "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    progress.close()
    model.eval()
    logits, labels = [], []
    order = rank_order(len(val_set), seed=0, epoch=0, rank=rank, world=world, shuffle=False)
    with torch.no_grad():
        for images, batch_labels, bad in loader(val_set, order, per_rank_batch, config.workers):
            val_skipped.update(bad)
            if batch_labels.numel():
                logits.append(model(images.to(device)).float().cpu())
                labels.append(batch_labels)
    part = (torch.cat(logits) if logits else torch.empty(0, num_classes),
            torch.cat(labels) if labels else torch.empty(0, dtype=torch.long), train_skipped, val_skipped)
    parts = all_gather_object(part, ctx) if ctx is not None else [part]
    all_logits, all_labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    top1, top5, per_class = accuracy_report(all_logits, all_labels, num_classes)
    skipped_keys = sorted([*train_skipped.union(*(p[2] for p in parts)), *val_skipped.union(*(p[3] for p in parts))])
    return LinearResult(config.protocol, top1, top5, len(train_set), len(all_labels), len(skipped_keys), per_class,
                        config.epochs, skipped_keys)

"""The paper's linear protocol: augmented views through a frozen encoder, head checkpointed each epoch.

See `pretrain.eval.linear` for the recipe. The head's checkpoint `linear-head.pt` in the output
folder holds {format, epoch, config, head, optimizer}; it is written atomically by rank 0 after
every epoch and read with `weights_only=True`, so a killed run resumes at the next epoch.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from pretrain.distributed import DistributedContext, all_gather_object, prepare_shard_sets
from pretrain.eval.linear import LinearConfig, LinearResult, accuracy_report, cosine_lr
from pretrain.eval.views import LabelledViews, class_count, labelled_samples, loader, rank_order
from pretrain.untrusted import TORCH_LOAD_ERRORS
from shards.atomic import atomic_output

HEAD_FORMAT = "relicv2-linear-head"
HEAD_FILE = "linear-head.pt"


class HeadCheckpointError(RuntimeError):
    """A head checkpoint that cannot be resumed (corrupt, foreign, or from another config)."""


def _config_dict(config: LinearConfig) -> dict:
    # Options that do not change the result (workers, feature batch) may differ on resume.
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("workers", "feature_batch")}


def load_head_checkpoint(path: Path, config: LinearConfig) -> dict | None:
    """The saved head state, or None when there is none; a foreign or mismatched file is an error."""
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except TORCH_LOAD_ERRORS as error:
        raise HeadCheckpointError(f"{path} is unreadable ({type(error).__name__}); delete it to start the "
                                  "linear evaluation over") from None
    if not isinstance(payload, dict) or payload.get("format") != HEAD_FORMAT:
        raise HeadCheckpointError(f"{path} is not a linear-head checkpoint; use another --output folder")
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in payload["config"].items()}
    wanted = {k: list(v) if isinstance(v, tuple) else v for k, v in _config_dict(config).items()}
    if saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        raise HeadCheckpointError(f"{path} was written with other linear options ({', '.join(changed)}); "
                                  "use another --output folder or the same options")
    return payload


def _average_gradients(module: nn.Module, ctx: DistributedContext | None) -> None:
    if ctx is None or not ctx.is_distributed:
        return
    for parameter in module.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= ctx.world_size


@torch.no_grad()
def _features(encoder: nn.Module, images: Tensor, device: torch.device) -> Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return encoder(images.to(device, non_blocking=True)).float()


def train_linear_paper(
    encoder: nn.Module,
    train_shards: str | Path,
    val_shards: str | Path,
    config: LinearConfig,
    *,
    device: torch.device,
    output_dir: Path | None,
    ctx: DistributedContext | None = None,
) -> LinearResult:
    """Train the head on augmented views of `train_shards`, score it on `val_shards` (exact over ranks)."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    per_rank_batch = max(1, config.batch_size // world)
    if config.backend == "dali":
        from pretrain.eval.dali_views import DECODE, DaliViews

        prepare_shard_sets(ctx, train_shards, val_shards, **DECODE)
        options = {"crop_size": config.crop_size, "resize_size": config.resize_size, "batch_size": per_rank_batch,
                   "rank": rank, "world": world, "threads": config.workers, "device": device}
        dali_train = DaliViews(train_shards, train=True, scale=config.crop_scale, seed=config.seed, **options)
        dali_val = DaliViews(val_shards, train=False, **options)
        train_samples, val_samples = dali_train.sample_set.samples, dali_val.sample_set.samples
        train_skipped, val_skipped = set(dali_train.sample_set.skipped_keys), set(dali_val.sample_set.skipped_keys)
    else:
        prepare_shard_sets(ctx, train_shards, val_shards)
        train_left_out: list[str] = []
        val_left_out: list[str] = []
        train_samples, _ = labelled_samples(train_shards, left_out=train_left_out)
        val_samples, _ = labelled_samples(val_shards, left_out=val_left_out)
        train_skipped, val_skipped = set(train_left_out), set(val_left_out)
    train_set = LabelledViews(train_samples, train=True, crop_size=config.crop_size,
                              resize_size=config.resize_size, scale=config.crop_scale, seed=config.seed)
    val_set = LabelledViews(val_samples, train=False, crop_size=config.crop_size, resize_size=config.resize_size)

    def train_batches(epoch: int):
        if config.backend == "dali":  # undecodable images were left out before: no batch holds one
            return ((images, labels, []) for images, labels, _ in dali_train.epoch())
        train_set.epoch = epoch
        order = rank_order(len(train_set), seed=config.seed, epoch=epoch, rank=rank, world=world, shuffle=True)
        return loader(train_set, order, per_rank_batch, config.workers)

    def val_batches():
        if config.backend == "dali":
            return ((images, labels, []) for images, labels, _ in dali_val.epoch())
        order = rank_order(len(val_set), seed=0, epoch=0, rank=rank, world=world, shuffle=False)
        return loader(val_set, order, per_rank_batch, config.workers)

    num_classes = class_count((train_samples, train_shards), (val_samples, val_shards))
    torch.manual_seed(config.seed)
    head = nn.Linear(encoder.num_features, num_classes).to(device)
    nn.init.normal_(head.weight, 0, 0.01)
    nn.init.zeros_(head.bias)
    optimizer = torch.optim.SGD(head.parameters(), lr=config.peak_lr, momentum=config.momentum,
                                nesterov=config.nesterov, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / per_rank_batch)
    total = steps_per_epoch * config.epochs
    checkpoint = output_dir / HEAD_FILE if output_dir is not None else None
    start_epoch = 0
    if checkpoint is not None and (saved := load_head_checkpoint(checkpoint, config)) is not None:
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = int(saved["epoch"])
    progress = tqdm(total=total, initial=start_epoch * steps_per_epoch, desc="linear", disable=rank != 0,
                    unit="step")
    for epoch in range(start_epoch, config.epochs):
        for step_in_epoch, (images, labels, bad) in enumerate(train_batches(epoch)):
            train_skipped.update(bad)  # a set: an undecodable image is met once per epoch, counted once
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(config.peak_lr, epoch * steps_per_epoch + step_in_epoch, total)
            if labels.numel():
                loss = F.cross_entropy(head(_features(encoder, images, device)), labels.to(device))
            else:  # every image of this batch was undecodable: still take part in the gradient average
                loss = head.weight.sum() * 0.0
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _average_gradients(head, ctx)
            optimizer.step()
            progress.update(1)
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
        if checkpoint is not None and rank == 0:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(checkpoint) as tmp:
                torch.save({"format": HEAD_FORMAT, "epoch": epoch + 1, "config": _config_dict(config),
                            "head": head.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    progress.close()
    logits, labels = [], []
    head.eval()
    with torch.no_grad():
        for images, batch_labels, bad in val_batches():
            val_skipped.update(bad)
            if batch_labels.numel():
                logits.append(head(_features(encoder, images, device)).float().cpu())
                labels.append(batch_labels)
    part = (torch.cat(logits) if logits else torch.empty(0, num_classes),
            torch.cat(labels) if labels else torch.empty(0, dtype=torch.long), train_skipped, val_skipped)
    parts = all_gather_object(part, ctx) if ctx is not None else [part]
    all_logits = torch.cat([p[0] for p in parts])
    all_labels = torch.cat([p[1] for p in parts])
    top1, top5, per_class = accuracy_report(all_logits, all_labels, num_classes)
    skipped_keys = sorted([*train_skipped.union(*(p[2] for p in parts)), *val_skipped.union(*(p[3] for p in parts))])
    return LinearResult(config.name, top1, top5, len(train_set), len(all_labels), len(skipped_keys), per_class,
                        config.epochs, skipped_keys)

"""The one supervised loop of the evaluation protocols that train (linear-fast, linear-paper, fine-tuning,
segmentation): `train_classifier` (per image or, with a dense loss, per pixel), resumable by epoch through a
`StateFile`, and `score`, exact over ranks."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from relicv2.evaluation.features import encoder_digest
from relicv2.jobs.progress import Phase
from relicv2.models.torchfile import StateDict, TorchFileError, TorchFormat
from relicv2.pretrain.distributed import DistributedContext, all_gather_object
from relicv2.pretrain.knn.outcome import LostSamples, figure, lost_fields

Batches = Iterable[tuple[Tensor, Tensor, list[str]]]  # images, labels, keys of the undecodable images


class HeadCheckpointError(TorchFileError):
    """A state file that cannot be resumed (corrupt, foreign, or from other options)."""


@dataclass(frozen=True)
class LinearResult:
    protocol: str
    top1: float
    top5: float | None  # None with fewer than 5 classes
    num_train: int
    num_val: int
    skipped: int  # undecodable images and structurally broken samples left out
    per_class_top1: dict[int, float] = field(default_factory=dict)
    epochs: int = 0
    skipped_keys: list[str] = field(default_factory=list)  # their keys, sorted
    lost: list[LostSamples] = field(default_factory=list)  # samples lost while reading (only when allowed)

    def as_json(self, *, checkpoint: str | None, random_init: int | None, extra: dict | None = None) -> dict:
        return {"protocol": self.protocol, "checkpoint": checkpoint, "random_init": random_init,
                "top1": figure(self.top1), "top5": figure(self.top5), "num_train": self.num_train,
                "num_val": self.num_val, "skipped": self.skipped, "skipped_keys": self.skipped_keys,
                **lost_fields(self.lost), "epochs": self.epochs,
                "per_class_top1": {str(k): figure(v) for k, v in sorted(self.per_class_top1.items())},
                **(extra or {})}


def topk_correct(logits: Tensor, labels: Tensor, k: int) -> int:
    """How many rows have their label among the k highest logits."""
    k = min(k, logits.shape[1])
    return int((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum())


def accuracy_report(logits: Tensor, labels: Tensor, num_classes: int) -> tuple[float, float | None, dict[int, float]]:
    """(top-1, top-5 or None when there are fewer than 5 classes, per-class top-1)."""
    if labels.numel() == 0:
        raise ValueError("no validation samples to score")
    top1 = topk_correct(logits, labels, 1) / labels.numel()
    top5 = topk_correct(logits, labels, 5) / labels.numel() if num_classes >= 5 else None
    predicted = logits.argmax(dim=1)
    per_class = {int(c): int((predicted[labels == c] == c).sum()) / int((labels == c).sum()) for c in labels.unique()}
    return top1, top5, per_class


def new_head(num_features: int, num_classes: int, generator: torch.Generator | None = None) -> nn.Linear:
    """A linear classifier initialised as the paper's protocols do: weights N(0, 0.01), bias 0."""
    head = nn.Linear(num_features, num_classes)
    nn.init.normal_(head.weight, 0, 0.01, generator=generator)
    nn.init.zeros_(head.bias)
    return head


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    # Tuples come back from older files as tuples and are written as lists: compare them alike.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


@dataclass(frozen=True)
class StateFile:
    """Where a protocol keeps its training state between epochs, and the settings it was trained with."""

    path: Path
    format: str
    config: Any  # the protocol's frozen config: a file written with other settings is refused
    ignored: tuple[str, ...]  # settings that do not change the result, free to differ on resume
    what: str  # the protocol, named in messages ("linear", "fine-tuning")
    network: str  # the key the classifier's weights are saved under
    inputs: dict[str, Any] = field(default_factory=dict)  # what it trains on (`trained_on`): others are refused

    @property
    def file(self) -> TorchFormat:
        """The state file's format: tagged per protocol, the classifier's weights under `network`."""
        return TorchFormat(f"{self.what} state file", tag=self.format, error=HeadCheckpointError,
                           fix=f"delete it to start the {self.what} evaluation over, or use another --output folder",
                           fields={"epoch": int, "config": dict, self.network: StateDict, "optimizer": dict})

    @property
    def options(self) -> dict[str, Any]:
        return _plain({k: v for k, v in dataclasses.asdict(self.config).items() if k not in self.ignored})

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the saved state into `model` and `optimizer`; the epoch to start at (0 without a file)."""
        if not self.path.is_file():
            return 0
        payload = self.file.load(self.path)
        saved = _plain(payload["config"])
        if saved != self.options:
            changed = sorted(k for k in set(saved) | set(self.options) if saved.get(k) != self.options.get(k))
            raise HeadCheckpointError(f"{self.path} was written with other {self.what} options ({', '.join(changed)}); "
                                      "use another --output folder or the same options")
        saved_inputs = payload.get("inputs", self.inputs)  # files from before inputs were recorded: unchecked
        if saved_inputs != self.inputs:
            changed = sorted(k for k in set(saved_inputs) | set(self.inputs)
                             if saved_inputs.get(k) != self.inputs.get(k))
            raise HeadCheckpointError(f"{self.path} was written for another {' and '.join(changed)}; use another "
                                      f"--output folder, or delete it to start the {self.what} evaluation over")
        model.load_state_dict(payload[self.network])
        optimizer.load_state_dict(payload["optimizer"])
        return payload["epoch"]

    def save(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.file.save(self.path, {"epoch": epoch, "config": self.options, "inputs": self.inputs,
                                   self.network: model.state_dict(), "optimizer": optimizer.state_dict()})


def trained_on(encoder: nn.Module, samples: Iterable[Any]) -> dict[str, str]:
    """What a state file's training depends on besides its options: the encoder it starts from and the
    training samples (a `SampleTable`, or items with a `key`), as digests of its weights and of the sorted
    keys; a resume with either changed would report a figure that belongs to neither."""
    keys = samples.keys() if hasattr(samples, "keys") else (item.key for item in samples)
    names = hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()
    return {"encoder": encoder_digest(encoder), "training set": names}


def train_classifier(
    model: nn.Module, forward: Callable[[Tensor], Tensor], optimizer: torch.optim.Optimizer, *,
    learning_rates: Callable[[int], Sequence[float]], train_batches: Callable[[int], Batches], epochs: int,
    steps_per_epoch: int, skipped: set[str], min_batch: int = 1, state: StateFile | None = None,
    ctx: DistributedContext | None = None, desc: str | None = None,
    loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
) -> None:
    """Train `model` (its parameters are what `optimizer` updates) with `loss(forward(images), labels)`
    (cross-entropy; a segmentation passes its per-pixel loss, labels [B, H, W]).

    `learning_rates(step)` gives each optimiser group's lr at the global step; `train_batches(epoch)`
    the epoch's batches on this rank. A batch with fewer than `min_batch` decodable images still takes
    part in the gradient average, with a zero loss. Undecodable keys are added to `skipped` (a set: an
    image met once per epoch is counted once). `desc` names the progress bar (None: no bar).
    """
    rank = ctx.rank if ctx is not None else 0
    device = next(model.parameters()).device
    start_epoch = state.restore(model, optimizer) if state is not None else 0
    progress = Phase(desc or "", steps_per_epoch * epochs, unit="step", enabled=desc is not None and rank == 0,
                     initial=start_epoch * steps_per_epoch)
    for epoch in range(start_epoch, epochs):
        model.train()
        for step_in_epoch, (images, labels, bad) in enumerate(train_batches(epoch)):
            skipped.update(bad)
            for group, lr in zip(optimizer.param_groups, learning_rates(epoch * steps_per_epoch + step_in_epoch),
                                 strict=True):
                group["lr"] = lr
            if len(labels) >= min_batch:
                value = loss(forward(images), labels.to(device))
            else:  # too few decodable images (BatchNorm in train mode needs two): a zero update, still averaged
                value = sum(p.sum() for p in model.parameters()) * 0.0
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            if ctx is not None and ctx.is_distributed:  # every rank steps with the mean gradient
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= ctx.world_size
            optimizer.step()
            progress.update(1)
            if progress.enabled:
                progress.set_postfix(epoch=epoch + 1, loss=value.item())
        if state is not None and rank == 0:
            state.save(epoch + 1, model, optimizer)
    progress.close()


def score(
    model: nn.Module, forward: Callable[[Tensor], Tensor], val_batches: Batches, *, protocol: str, num_classes: int,
    num_train: int, epochs: int, train_skipped: set[str], val_skipped: set[str], ctx: DistributedContext | None = None,
) -> LinearResult:
    """Top-1/top-5 of `forward` on the validation batches, gathered over ranks with every rank's skipped keys."""
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for images, batch_labels, bad in val_batches:
            val_skipped.update(bad)
            if batch_labels.numel():
                logits.append(forward(images).float().cpu())
                labels.append(batch_labels)
    part = (torch.cat(logits) if logits else torch.empty(0, num_classes),
            torch.cat(labels) if labels else torch.empty(0, dtype=torch.long), train_skipped, val_skipped)
    parts = all_gather_object(part, ctx) if ctx is not None else [part]
    all_logits, all_labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    top1, top5, per_class = accuracy_report(all_logits, all_labels, num_classes)
    skipped_keys = sorted([*train_skipped.union(*(p[2] for p in parts)), *val_skipped.union(*(p[3] for p in parts))])
    return LinearResult(protocol, top1, top5, num_train, len(all_labels), len(skipped_keys), per_class, epochs,
                        skipped_keys)

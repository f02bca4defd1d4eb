"""`relicv2 eval segment`: the encoder as the backbone of a fully convolutional network, fine-tuned on a
segmentation set and scored by mIoU, after the protocol of MoCo (He et al. 2020, appendix) that the paper
cites and BYOL (Grill et al. 2020, appendix) repeats:
- network: the ResNet with its last stage dilated (stride 1, dilation 2: output stride 16, `models.dilated`),
  then two 3x3 convolutions of 256 channels with dilation 6, each with BN and ReLU, and a 1x1 convolution to
  the classes; the logits upsampled bilinearly to the input's size (FCN-16s, DeepLab's large field of view);
- training: per-pixel softmax cross-entropy without the IGNORE pixels, SGD (momentum 0.9, weight decay 1e-4),
  batch 16, lr 0.003 on VOC (0.01 on Cityscapes) times 0.1 at 70% and 90% of the steps; views randomly
  scaled by [0.5, 2.0], cropped (513 on VOC, 769 on Cityscapes; padding ignored) and flipped;
- scoring: each whole image at its own size (MoCo), per-class IoU from one confusion matrix over the set.
The paper's epochs stand for MoCo's iterations: 45 on VOC train_aug2012, 160 on Cityscapes train_fine.
Trained through the one supervised loop, resumable by epoch (OUT/segment.pt); the result is OUT/segment.json.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relicv2.evaluation import supervised
from relicv2.evaluation.job import Backbone, check_outputs, load_encoder, save_settings, write_json
from relicv2.evaluation.segment_data import (
    CLASSES,
    IGNORE,
    VOC_AUG,
    SegmentDataError,
    SegmentViews,
    epoch_batches,
    list_pairs,
    train_ids,
)
from relicv2.jobs.config import (
    Presets,
    is_file_reference,
    resolve,
    to_dict,
)
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.models.dilated import dilate
from relicv2.models.resnet import ResNet
from relicv2.pretrain.schedules import peak_learning_rate, step_decay

PRESETS = Presets(job="relicv2 eval segment", package="relicv2.evaluation", folder="presets/segment")
STATE_FILE, STATE_FORMAT, RESULT_FILE = "segment.pt", "relicv2-segment", "segment.json"
SPLITS = {"voc": (VOC_AUG, "val"), "cityscapes": ("train", "val")}  # the layouts' default train and val splits


@dataclass(frozen=True)
class SegmentConfig:
    """Options of `relicv2 eval segment` (presets in `evaluation/presets/segment/`; the defaults: `paper`)."""

    preset: str = "paper"  # the preset's name (or the YAML file's stem) the settings came from
    layout: Literal["voc", "cityscapes", "folder"] = "voc"  # how --data is laid out
    # voc: an image set (train_aug, train, val, trainval); cityscapes: train or val (fine); folder: a
    # subfolder holding images/ and masks/, or a file of image names; "": the layout's own (voc train_aug and
    # val, cityscapes train and val; for a folder, every pair in --data)
    train_split: str = ""
    val_split: str = ""  # the set scored, as train_split
    year: str = "2012"  # of a VOC layout
    num_classes: int = 0  # 0: the layout's (VOC 21, Cityscapes 19, a binarised folder 2)
    binarise: int = 0  # above 0: read grey 0-255 masks (saliency masks) as two classes, 1 where >= binarise
    epochs: int = 45  # the paper: 45 on VOC train_aug, 160 on Cityscapes (MoCo: 30k / 90k iterations)
    batch_size: int = 16  # images per step
    lr: float = 0.003  # at `reference_batch`; scaled linearly with batch_size
    reference_batch: int = 16  # the batch `lr` is given for
    milestones: tuple[float, float] = (0.7, 0.9)  # fractions of the steps where the lr is multiplied by `decay`
    decay: float = 0.1  # the lr factor at each milestone
    weight_decay: float = 1e-4  # of SGD, on every parameter
    momentum: float = 0.9  # of SGD
    crop_size: int = 513  # train crops; scoring takes each whole image
    scale_range: tuple[float, float] = (0.5, 2.0)  # random scaling of train images before the crop
    resize: int = 0  # short side every image (and mask) is first resized to; 0: as stored
    output_stride: Literal[8, 16, 32] = 16  # of the dilated encoder (16: layer4 dilated, MoCo's FCN-16s)
    head_channels: int = 256  # of the head's two 3x3 convolutions
    head_dilation: int = 6  # of the head's two 3x3 convolutions (DeepLab's large field of view)
    seed: int = 0  # of the head's initialisation and the train views
    workers: int = 2  # image-reading processes (free to change on resume)

    def __post_init__(self) -> None:
        if min(self.epochs, self.batch_size, self.reference_batch, self.head_channels, self.head_dilation) < 1:
            raise ValueError("epochs, batch_size, reference_batch, head_channels and head_dilation must be positive")
        if self.crop_size < 16 or self.lr <= 0 or not 0 < self.decay <= 1 or not 0 <= self.binarise <= 255:
            raise ValueError("crop_size must be at least 16, lr > 0, decay in (0, 1] and binarise within 0..255")
        if not 0 < self.scale_range[0] <= self.scale_range[1] or self.resize < 0 or self.num_classes < 0:
            raise ValueError("scale_range must be 0 < low <= high, resize and num_classes not negative")

    @property
    def protocol(self) -> str:
        return f"segment-{self.preset}"

    @property
    def splits(self) -> tuple[str, str]:
        own = SPLITS.get(self.layout, ("", ""))
        return self.train_split or own[0], self.val_split or own[1]

    @property
    def classes(self) -> int:
        if self.num_classes:
            return self.num_classes
        if self.binarise:
            return 2
        if self.layout in CLASSES:
            return CLASSES[self.layout]
        raise SegmentDataError("a folder of index masks needs num_classes (--set num_classes=N), or binarise "
                               "for grey masks")


def load_segment_config(config: str | Path = "paper", overrides: Sequence[str] = ()) -> SegmentConfig:
    """A segmentation preset (`paper`, `cityscapes`, `fast`) or YAML file, with `key=value` overrides."""
    label = Path(config).stem if is_file_reference(config) else str(config)
    return resolve(SegmentConfig, config, overrides, PRESETS, defaults={"preset": label})


def _conv_bn_relu(cin: int, cout: int, dilation: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SegmentationNet(nn.Module):
    """Images [B, 3, H, W] (ImageNet-normalised) -> class logits [B, C, H, W]: the dilated encoder and the
    FCN head of MoCo's protocol."""

    def __init__(self, encoder: ResNet, num_classes: int, *, output_stride: int = 16, channels: int = 256,
                 dilation: int = 6):
        super().__init__()
        self.encoder = dilate(encoder, output_stride)
        self.head = nn.Sequential(_conv_bn_relu(encoder.num_features, channels, dilation),
                                  _conv_bn_relu(channels, channels, dilation), nn.Conv2d(channels, num_classes, 1))

    def forward(self, images: Tensor) -> Tensor:
        e = self.encoder
        x = e.layer4(e.layer3(e.layer2(e.layer1(e.maxpool(e.relu(e.bn1(e.conv1(images))))))))
        return F.interpolate(self.head(x), size=images.shape[-2:], mode="bilinear", align_corners=False)


def pixel_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-pixel cross-entropy over the labelled pixels; 0 (still a graph) when a batch has none."""
    if not (labels != IGNORE).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits, labels, ignore_index=IGNORE)


def confusion(predicted: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """[C, C] pixel counts, rows the true class, columns the predicted one; IGNORE pixels left out."""
    keep = labels != IGNORE
    cells = labels[keep].long() * num_classes + predicted[keep].long()
    return torch.bincount(cells, minlength=num_classes * num_classes).view(num_classes, num_classes)


def class_iou(matrix: Tensor) -> list[float | None]:
    """IoU = TP / (TP + FP + FN) per class; None for a class neither in the truth nor predicted."""
    matrix = matrix.double()
    union = matrix.sum(0) + matrix.sum(1) - matrix.diag()
    return [float(tp / u) if u > 0 else None for tp, u in zip(matrix.diag(), union, strict=True)]


def mean_iou(matrix: Tensor) -> float:
    """The mean of `class_iou` over the classes it defines."""
    scores = [iou for iou in class_iou(matrix) if iou is not None]
    return sum(scores) / len(scores) if scores else 0.0


def learning_rates(config: SegmentConfig, total_steps: int) -> Callable[[int], list[float]]:
    """The lr at a global step: scaled with the batch, times `decay` at each milestone fraction of the steps."""
    peak = peak_learning_rate(config.lr, config.batch_size, config.reference_batch)
    milestones = [math.floor(fraction * total_steps) for fraction in config.milestones]
    return lambda step: [step_decay(step, peak_lr=peak, milestones=milestones, decay=config.decay)]


def segment(encoder: ResNet, data: Path, config: SegmentConfig, *, device: torch.device,
            output_dir: Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune `encoder` in the FCN on the train split of `data`, score the val split; the figures."""
    train_split, val_split = config.splits
    if train_split == val_split:
        raise SegmentDataError(f"train_split and val_split are both {train_split or 'every pair'!r}: the network "
                               "would be scored on the images it trained on; give two splits")
    num_classes = config.classes
    train_pairs, val_pairs = (list_pairs(config.layout, data, split, year=config.year)
                              for split in (train_split, val_split))
    log(f"{len(train_pairs)} train and {len(val_pairs)} val pairs in {data} ({config.layout}: {train_split or 'all'}"
        f" / {val_split or 'all'}), {num_classes} classes")
    common = dict(num_classes=num_classes, crop_size=config.crop_size, resize=config.resize,
                  binarise=config.binarise, table=train_ids() if config.layout == "cityscapes" else None)
    train_set = SegmentViews(train_pairs, train=True, scale=config.scale_range, seed=config.seed, **common)
    val_set = SegmentViews(val_pairs, train=False, **common)
    torch.manual_seed(config.seed)
    model = SegmentationNet(encoder, num_classes, output_stride=config.output_stride,
                            channels=config.head_channels, dilation=config.head_dilation).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    steps_per_epoch = max(1, len(train_set) // config.batch_size)
    state = (supervised.StateFile(Path(output_dir) / STATE_FILE, STATE_FORMAT, config, ("workers",),
                                  what="segmentation", network="model",
                                  inputs=supervised.trained_on(encoder, train_pairs))
             if output_dir is not None else None)
    train_skipped: set[str] = set()
    started = time.monotonic()
    supervised.train_classifier(
        model, lambda images: model(images.to(device)), optimizer,
        learning_rates=learning_rates(config, steps_per_epoch * config.epochs),
        train_batches=lambda epoch: epoch_batches(train_set, epoch, batch_size=config.batch_size,
                                                  workers=config.workers),
        epochs=config.epochs, steps_per_epoch=steps_per_epoch, skipped=train_skipped, min_batch=2, state=state,
        desc=config.protocol, loss=pixel_loss)
    trained = time.monotonic()
    matrix, val_skipped = score_segmentation(model, val_set, num_classes, device=device, workers=config.workers)
    for pairs, lost, split in ((train_pairs, train_skipped, train_split), (val_pairs, val_skipped, val_split)):
        if len(lost) == len(pairs):
            raise SegmentDataError(f"{data}: every pair of {split or 'the set'!r} was unusable (named above); "
                                   "fix the masks or the settings (num_classes, binarise)")
    skipped = sorted(train_skipped | val_skipped)
    return {"protocol": config.protocol, "miou": mean_iou(matrix),
            "pixel_accuracy": float(matrix.diag().sum() / max(1, int(matrix.sum()))),
            "per_class_iou": {str(c): iou for c, iou in enumerate(class_iou(matrix))}, "num_classes": num_classes,
            "num_train": len(train_pairs), "num_val": len(val_pairs), "skipped": len(skipped),
            "skipped_keys": skipped, "epochs": config.epochs, "train_seconds": round(trained - started, 1),
            "score_seconds": round(time.monotonic() - trained, 1), "confusion": matrix.tolist()}


def score_segmentation(model: nn.Module, views: SegmentViews, num_classes: int, *, device: torch.device,
                       workers: int = 0) -> tuple[Tensor, set[str]]:
    """(the confusion matrix of `model`'s argmax over every image of `views`, the keys of unusable pairs)."""
    model.eval()
    matrix = torch.zeros(num_classes, num_classes, dtype=torch.long)
    skipped: set[str] = set()
    with torch.no_grad(), Phase("segment: scoring", len(views), unit="image") as bar:
        for images, masks, bad in epoch_batches(views, 0, batch_size=1, workers=workers):
            skipped.update(bad)
            if len(masks):
                matrix += confusion(model(images.to(device)).argmax(1).cpu(), masks, num_classes)
            bar.update(len(masks) + len(bad))
    return matrix, skipped


def run_segment(backbone: Backbone, data: Path, output: Path, config: SegmentConfig, *, json_path: Path | None = None,
                device: str = "auto", log: Callable[[str], None] = print) -> list[str]:
    """The command: load the encoder, fine-tune and score, write OUT/segment.json (and `json_path`); the lines
    to print. Errors a user can cause raise ValueErrors (SegmentDataError, torch-file errors) or
    FolderLockedError, before any training where they can be found before."""
    check_outputs(output, json_path)
    encoder, record = load_encoder(backbone)
    torch_device = resolve_device(device, "--device")
    with folder_lock(output, "relicv2 eval segment"):
        save_settings(output, config, {"backbone": backbone.as_dict(), "data": str(data)}, log)
        figures = segment(encoder, data, config, device=torch_device, output_dir=output, log=log)
    result = {**figures, "encoder": backbone.describe(), "checkpoint": record["checkpoint"],
              "random_init": backbone.random_depth, "network": record["network"], "step": record["step"],
              "data": str(data), "layout": config.layout, "device": str(torch_device), "config": to_dict(config)}
    write_json(result, (output / RESULT_FILE, "--output"), (json_path, "--json"))
    ious = ", ".join(f"{c} {iou:.4f}" if iou is not None else f"{c} -" for c, iou in result["per_class_iou"].items())
    lines = [f"{result['protocol']} of {result['encoder']} on {data}: mIoU {result['miou']:.4f}, pixel accuracy "
             f"{result['pixel_accuracy']:.4f} ({result['num_train']} train, {result['num_val']} val images, "
             f"{result['epochs']} epochs, {result['train_seconds']} s training on {torch_device})",
             f"  per-class IoU: {ious}"]
    if figures["skipped_keys"]:
        lines.append(f"warning: {figures['skipped']} unusable pair(s) left out: {', '.join(figures['skipped_keys'][:5])}"
                     f"{' ...' if figures['skipped'] > 5 else ''} (all in {RESULT_FILE})")
    return lines

"""Scores for `saliency train --gt`: raw maps vs refined labels per method, the mean of the refined labels
(what the fused network is trained to fit), the fused network, and the per-pixel mean of the handcrafted maps
(the trivial fusion the network must beat).

Everything is scored at the image's own resolution with `saliency.metrics`; labels and predictions made
at the network's input size are resized back (bilinear; binary labels nearest).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import cv2
import numpy as np

from relicv2.jobs.progress import tracked
from relicv2.saliency.images import list_images, map_path, read_gray, read_rgb
from relicv2.saliency.metrics import aggregate, score_image
from relicv2.saliency.network.data import handcrafted_maps
from relicv2.saliency.network.images import resize_map
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.predictor import mean_of_maps, predict_map
from relicv2.shards import ReadReport, iter_samples
from relicv2.shards.images import ImageLoadError, load_rgb

MEAN_ROW = "mean of handcrafted"
LABELS_ROW = "mean of refined labels"
MAP_LABELS_ROW = "mean of binarised maps"  # the same with no phase I (iterations 0): what phase II fits
FUSED_ROW = "fused network"

RowFn = Callable[[str, int, np.ndarray], np.ndarray]

# What counts as a ground-truth mask: an image whose pixels are grey (R, G and B within
# GREY_TOLERANCE of each other, which a greyscale, 1-bit or grey-palette file always is and a colour
# JPEG of a black-and-white mask nearly is) on at least GREY_FRACTION of its pixels. A photo fails
# this; a greyscale photo would pass (nothing short of the values tells it from a graded mask such
# as PASCAL-S's, so graded masks are accepted and binarised at 128 by `saliency.metrics`).
GREY_TOLERANCE = 8
GREY_FRACTION = 0.99


class GroundTruthError(ValueError):
    """A --gt folder that cannot score the run: missing, no mask named like the images, or not masks."""


def mask_problem(path: Path) -> str | None:
    """Why the file at `path` is not a ground-truth mask (see GREY_TOLERANCE), or None when it is one."""
    try:
        rgb = read_rgb(path)
    except ImageLoadError as error:
        return str(error)
    spread = rgb.max(axis=2).astype(np.int16) - rgb.min(axis=2)
    coloured = float(np.mean(spread > GREY_TOLERANCE))
    if coloured > 1.0 - GREY_FRACTION:
        return f"{path} is a colour image ({coloured:.0%} of its pixels are not grey), not a mask"
    return None


def check_ground_truth(gt: Path, keys: Iterable[str]) -> None:
    """Refuse `gt` unless it is a folder holding, for at least one of `keys`, a mask `KEY.<image ext>`,
    and every such mask is one (`mask_problem`). Reads each matching mask once: seconds for
    thousands, before hours of training."""
    gt = Path(gt)
    if not gt.is_dir():
        raise GroundTruthError(f"--gt {gt}: no such folder; give the folder of ground-truth masks (KEY.png)")
    masks = {p.stem: p for p in list_images(gt)}
    keys = sorted(set(keys))
    matched = [masks[k] for k in keys if k in masks]
    if not matched:
        names = sorted(p.name for p in masks.values())
        found = f"it holds {', '.join(names[:2])}{', ...' if len(names) > 2 else ''}" if names else "it holds no image"
        raise GroundTruthError(
            f"--gt {gt}: no mask is named like an image of the run ({found}); expected files named by the "
            f"sample keys, e.g. {keys[0] if keys else 'KEY'}.png"
        )
    problems = [(p, why) for p in matched if (why := mask_problem(p)) is not None]
    if problems:
        raise GroundTruthError(
            f"--gt {gt}: {len(problems)} of {len(matched)} matching files are not masks, e.g. {problems[0][1]}; "
            "a mask is a greyscale (or 1-bit, or grey-palette) image, foreground >= 128"
        )


def _nearest(label: np.ndarray, width: int, height: int) -> np.ndarray:
    return cv2.resize(label.astype(np.uint8), (width, height), interpolation=cv2.INTER_NEAREST).astype(np.float32)


def score_rows(images: Iterator[tuple[str, int, np.ndarray]], gt: Path, rows: dict[str, RowFn],
               total: int, desc: str, progress: bool) -> dict[str, dict]:
    """Per row name: aggregate scores over the images that have a ground-truth mask."""
    masks = {p.stem: p for p in list_images(gt)}
    scores: dict[str, list] = {name: [] for name in rows}
    missing = 0
    for key, index, rgb in tracked(images, desc, total, unit="img", enabled=progress):
        if key not in masks:
            missing += 1
            continue
        try:
            mask = read_gray(masks[key])
        except ImageLoadError as error:
            print(f"report: skipping {key}: {error}", file=sys.stderr)
            continue
        if mask.shape != rgb.shape[:2]:
            print(f"report: skipping {key}: mask {mask.shape} differs from image {rgb.shape[:2]}", file=sys.stderr)
            continue
        for name, row in rows.items():
            scores[name].append(score_image(row(key, index, rgb), mask))
    if missing:
        print(f"report: {missing} images have no mask in {gt} and are not scored", file=sys.stderr)
    return {name: aggregate(items).as_dict() for name, items in scores.items()}


def _raw(folder: Path, method: str) -> RowFn:
    return lambda key, _i, _rgb: read_gray(map_path(folder, method, key)) / 255.0


def _mean_of(folder: Path, methods: tuple[str, ...]) -> RowFn:
    return lambda key, _i, _rgb: mean_of_maps(folder, methods, key)


def evaluate_report(job, data, trainer, model: SaliencyNet, *, progress: bool = True) -> dict:
    """{"train": {row: scores}, "heldout": {row: scores} (with --eval-shards)}."""
    config, out = job.config, Path(job.out)
    maps = out / "maps"
    position = {key: i for i, key in enumerate(data.keys)}
    rows: dict[str, RowFn] = {}
    for m in config.methods:
        rows[f"{m} raw map"] = raw = _raw(maps, m)
        threshold = config.thresholds[m]
        rows[f"{m} raw >= {threshold:g}"] = lambda *at, raw=raw, t=threshold: (raw(*at) >= t).astype(np.float32)
        for k in range(1, config.iterations + 1):
            average = trainer.result(f"{m}-it{k}").float().numpy()
            rows[f"{m} refined it{k}"] = lambda _k, i, rgb, a=average: _nearest(a[i] >= 0.5, rgb.shape[1], rgb.shape[0])
    # What phase II fits: the per-pixel mean of the methods' binarised labels (the last round's, or the maps').
    fitted = trainer.fused_labels().float().mean(1).numpy()
    labels_row = LABELS_ROW if config.iterations else MAP_LABELS_ROW
    rows[labels_row] = lambda _k, i, rgb: resize_map(fitted[i], rgb.shape[1], rgb.shape[0])
    rows[MEAN_ROW] = _mean_of(maps, config.methods)
    rows[FUSED_ROW] = lambda _k, _i, rgb: predict_map(model, rgb, config.input_size)

    train_images = _decoded(out / "sample", lambda key, _i: position.get(key))
    report = {"train": score_rows(train_images, job.gt, rows, len(position), "report (train)", progress)}
    if job.eval_shards is not None:
        eval_maps = out / "eval-maps"
        failed = dict(handcrafted_maps(Path(job.eval_shards), eval_maps, config.methods, config.workers, progress))
        held: dict[str, RowFn] = {f"{m} raw map": _raw(eval_maps, m) for m in config.methods}
        held[MEAN_ROW] = _mean_of(eval_maps, config.methods)
        held[FUSED_ROW] = rows[FUSED_ROW]
        held_images = _decoded(Path(job.eval_shards), lambda key, i: None if key in failed else i)
        report["heldout"] = score_rows(held_images, job.gt, held, None, "report (held out)", progress)
    return report


def _decoded(shards: Path, number: Callable[[str, int], int | None]) -> Iterator[tuple[str, int, np.ndarray]]:
    """(key, number, rgb) of the samples of `shards` that `number(key, position)` numbers (None: left out);
    the reader's refusals and undecodable images are said on stderr."""
    read = ReadReport()
    for position, sample in enumerate(iter_samples(shards, report=read)):
        if (index := number(sample["key"], position)) is None:
            continue
        try:
            yield sample["key"], index, load_rgb(sample["image"], sample["key"])
        except ImageLoadError as error:
            print(f"report: skipping {error}", file=sys.stderr)
    if not read.ok:
        print(f"report: {shards}: {read.summary()}", file=sys.stderr)


def format_report(report: dict) -> str:
    """The report's score tables as text."""
    lines = []
    for part in [part for part in ("train", "heldout") if part in report]:
        lines += [f"\n{part} images:", f"{'':28s} {'MAE':>7s} {'max-F':>7s} {'adapt-F':>7s} {'count':>6s}"]
        for name, s in report[part].items():
            values = " ".join("      -" if s[k] is None else f"{s[k]:7.3f}" for k in ("mae", "max_f", "adaptive_f"))
            lines.append(f"{name:28s} {values} {s['count']:6d}")
    return "\n".join(lines)

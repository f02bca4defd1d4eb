"""The report's segmentation section, from the `segment.json` files of `relicv2 eval segment` (or folders
holding them): one row per run (encoder, set, mIoU, pixel accuracy, sizes) and one row of per-class IoU each,
the pretrained encoders above their random-init baselines. Shown only when such files are given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from relicv2.evaluation.report.inputs import read_json

SECTION = ("segmentation", "Segmentation: mIoU of the fine-tuned FCN (eval segment)")


def segmentation_section(page: Any, paths: tuple[Path, ...], table: Callable[..., str],
                         notes: Callable[[list[str]], str], fmt: Callable[[object], str]) -> None:
    """Fill the section on `page` (html's `_Page`) from `paths`; an unreadable file is named among the
    problems and left out, never raised."""
    files = [file for path in map(Path, paths)
             for file in (sorted(path.glob("**/segment.json")) if path.is_dir() else [path])]
    runs = []
    for path in files:
        result, problem = read_json(path)
        try:
            if problem is not None:
                raise ValueError(problem)
            ious = {str(c): iou for c, iou in result["per_class_iou"].items()}
            runs.append((bool(result["random_init"]), [
                result["encoder"], result["protocol"], f"{result['data']} ({result['layout']})",
                fmt(float(result["miou"])), fmt(float(result["pixel_accuracy"])), fmt(result["num_train"]),
                fmt(result["num_val"]), fmt(result["epochs"])], ious))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            page.summary.problems.append(f"{path}: not a segment.json of relicv2 eval segment ({error})")
    if not runs:
        return page.not_run(SECTION[0], "no readable segment.json among " + ", ".join(map(str, paths)))
    runs.sort(key=lambda run: run[0])
    classes = sorted({c for _, _, ious in runs for c in ious}, key=lambda c: (len(c), c))
    page.ok(SECTION[0], "".join([
        table(["encoder", "protocol", "set", "mIoU", "pixel acc.", "train", "val", "epochs"],
              [row for _, row, _ in runs], css="segmentation"),
        table(["encoder", *(f"IoU {c}" for c in classes)],
              [[row[0], *(fmt(ious.get(c)) for c in classes)] for _, row, ious in runs], css="segmentation-classes"),
        notes(["mIoU: the mean over classes of TP / (TP + FP + FN), from one confusion matrix over the val set; "
               "pixels marked 255 are not scored"])]))

"""Score saliency maps against ground-truth masks (``relicv2 saliency evaluate``, ``saliency.metrics``):
a folder of maps, a folder of per-method sub-folders (``saliency handcrafted``'s layout), or a saved
saliency model run on a folder of images. Maps or images and masks are matched by file stem.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relicv2.saliency.handcrafted import METHOD_NAMES
from relicv2.saliency.images import list_images, map_to_uint8, read_gray, read_rgb
from relicv2.saliency.metrics import DatasetScores, aggregate, score_image


class EvaluationError(ValueError):
    """Missing, mismatched or unreadable files; the message says which and what to do."""


@dataclass(frozen=True)
class EvaluateConfig:
    pred: Path
    gt: Path
    allow_missing: bool = False


def _by_stem(folder: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in list_images(folder):
        if path.stem in files:
            raise EvaluationError(f"{folder}: two files named {path.stem}.*; keep one per image")
        files[path.stem] = path
    return files


def prediction_sets(pred: Path) -> dict[str, Path]:
    """Name -> folder of maps: ``pred`` itself if it holds images, else its sub-folders that do."""
    pred = Path(pred)
    if not pred.is_dir():
        raise EvaluationError(f"prediction folder {pred} does not exist; check --pred")
    if list_images(pred):
        return {pred.name: pred}
    sets = {d.name: d for d in sorted(pred.iterdir()) if d.is_dir() and list_images(d)}
    if not sets:
        raise EvaluationError(f"no saliency maps in {pred} or its sub-folders; check --pred")
    return sets


def _score_pairs(predictions: dict[str, Path], gt: Path, read: Callable[[Path], np.ndarray], what: str,
                 allow_missing: bool) -> DatasetScores:
    """Score ``read(predictions[stem])`` against the mask of each stem in ``gt``; ``what`` names the
    prediction side in messages (the maps' or the images' folder)."""
    masks = _by_stem(gt)
    missing = sorted(set(masks) - set(predictions))
    extra = sorted(set(predictions) - set(masks))
    common = sorted(set(masks) & set(predictions))
    if not common:
        raise EvaluationError(
            f"no file in {what} has a mask of the same name in {gt} (e.g. {sorted(predictions)[:3]}"
            f" vs {sorted(masks)[:3]}); check the folders"
        )
    if extra and not allow_missing:
        raise EvaluationError(
            f"{len(extra)} file(s) in {what} have no ground truth in {gt}: {', '.join(extra[:5])}; "
            "pass --allow-missing to score only the images that have both"
        )
    if missing and not allow_missing:
        raise EvaluationError(
            f"{len(missing)} mask(s) in {gt} have no map in {what}: {', '.join(missing[:5])}; "
            "compute them or pass --allow-missing to score the others"
        )
    scores = []
    for stem in common:
        prediction, mask = read(predictions[stem]), read_gray(masks[stem])
        if prediction.shape != mask.shape:
            raise EvaluationError(
                f"{predictions[stem]} is {prediction.shape[1]}x{prediction.shape[0]} but its mask "
                f"{masks[stem]} is {mask.shape[1]}x{mask.shape[0]}; a map (or image) and its mask must have the same size"
            )
        scores.append(score_image(prediction, mask))
    return aggregate(scores)


def evaluate_folder(maps: Path, gt: Path, allow_missing: bool = False) -> DatasetScores:
    """Score every map of ``maps`` against the mask of the same stem in ``gt``."""
    return _score_pairs(_by_stem(maps), gt, read_gray, str(maps), allow_missing)


@dataclass(frozen=True)
class ModelEvaluation:
    """A saved saliency model scored on a folder of images: how its maps are predicted."""

    model: Path  # model.pt, or the `saliency train` output folder holding it
    images: Path
    gt: Path
    flip: bool = False  # average with the prediction of the mirrored image
    crf: bool = False  # refine each prediction with the model's dense CRF (saliency.network.crf.model_crf)
    maps: Path | None = None  # `saliency handcrafted` output: average with the mean of these maps
    allow_missing: bool = False
    device: str = "cpu"


def evaluate_model(job: ModelEvaluation) -> DatasetScores:
    """Predict every image of ``job.images`` with the model and score the maps against ``job.gt``, each
    through an 8-bit map, so that a model scores what its written maps score."""
    from relicv2.saliency.network.crf import model_crf
    from relicv2.saliency.network.model_file import load_model
    from relicv2.saliency.network.predictor import mean_of_maps, predict_map, with_maps

    for option, folder in (("--images", job.images), ("--gt", job.gt)):
        if not Path(folder).is_dir():
            raise EvaluationError(f"{option} folder {folder} does not exist; check {option}")
    model, info = load_model(job.model, job.device)
    size = int(info["input_size"])
    crf = model_crf(info, str(job.model)) if job.crf else None
    # The handcrafted methods with a map folder in --maps (a `saliency handcrafted` output).
    methods = tuple(m for m in METHOD_NAMES if job.maps is not None and (Path(job.maps) / m).is_dir())
    if job.maps is not None and not methods:
        raise EvaluationError(f"--maps {job.maps} holds no map folder ({', '.join(METHOD_NAMES)}); "
                              "give the --output folder of `relicv2 saliency handcrafted`")

    def read(path: Path) -> np.ndarray:
        prediction = predict_map(model, read_rgb(path), size, flip=job.flip, crf=crf)
        if methods:
            prediction = with_maps(prediction, mean_of_maps(job.maps, methods, path.stem))
        return map_to_uint8(prediction)

    return _score_pairs(_by_stem(job.images), job.gt, read, str(job.images), job.allow_missing)


def evaluate(config: EvaluateConfig) -> dict[str, DatasetScores]:
    """Scores of every prediction set under ``config.pred`` against ``config.gt``."""
    if not Path(config.gt).is_dir():
        raise EvaluationError(f"ground-truth folder {config.gt} does not exist; check --gt")
    return {name: evaluate_folder(folder, config.gt, config.allow_missing)
            for name, folder in prediction_sets(config.pred).items()}


COLUMNS = ("method", "mae", "max_f", "adaptive_f", "s_measure", "count")


def format_table(results: dict[str, DatasetScores]) -> str:
    """A Markdown table, one row per prediction set."""
    lines = [
        "| method | MAE | max-F | adaptive-F | S-measure | count |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {s.mae:.3f} | {s.max_f:.3f} | {s.adaptive_f:.3f} | {s.s_measure:.3f} | {s.count} |"
              for name, s in results.items()]
    return "\n".join(lines)


def write_json(results: dict[str, DatasetScores], path: Path) -> None:
    Path(path).write_text(json.dumps({n: s.as_dict() for n, s in results.items()}, indent=2) + "\n")


def write_csv(results: dict[str, DatasetScores], path: Path) -> None:
    with Path(path).open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(COLUMNS)
        writer.writerows([name, s.mae, s.max_f, s.adaptive_f, s.s_measure, s.count] for name, s in results.items())

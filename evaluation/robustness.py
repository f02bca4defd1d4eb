"""`relicv2 eval robustness`: the paper's zero-shot robustness protocol. A frozen encoder and the linear head
`eval linear` trained for it on the clean training set (`head_file`) score, with no training:
- corrupted copies of a labelled val set (`corrupted`): each of the chosen ImageNet-C corruptions at each
  chosen severity, the head's evaluation view corrupted and stored as JPEG in a shard set in the output
  folder, then read without a second crop;
- the released ImageNet-C (`corruption/severity/class/image`);
- the out-of-distribution sets (`ood`).
Every set is read through the shard reader (a folder is built into shards in the output folder first) and
its result is cached in `results/` under the identity of the encoder, the head and the set's files, so an
interrupted run resumes to the same JSON (`robustness.json`).

Corruption error (Hendrycks & Dietterich 2019): CE_c = sum over severities of the top-1 error / the same sum
of a baseline's; mCE is the mean over corruptions. The baseline is AlexNet's published errors for the
released ImageNet-C (all five severities), the control encoder and head the user names for generated sets.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from relicv2.evaluation.corrupted import CorruptionSpec, corrupt_shard_set, corruption_pool
from relicv2.evaluation.corruptions import (
    CORRUPTIONS,
    MIN_SIDE,
    SEVERITIES,
    CorruptionError,
    check_corruption,
)
from relicv2.evaluation.features import encoder_digest, shard_set_fingerprint
from relicv2.evaluation.head_file import TrainedHead, load_head, score_head
from relicv2.evaluation.job import Backbone, check_outputs, load_encoder, save_settings, write_json
from relicv2.evaluation.ood import head_wnids, image_folder, targets
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.config import ConfigError, Presets, resolve, to_dict
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.pretrain.knn.classes import class_names
from relicv2.pretrain.knn.outcome import figure
from relicv2.shards.build import shards_of
from relicv2.shards.shardset import ShardSet, resolve_shard_set

COMMAND = "relicv2 eval robustness"
PRESETS = Presets(job=COMMAND, package="relicv2.evaluation", folder="presets/robustness")
RESULT_FILE = "robustness.json"
# Which images the encoder's head got right in each corrupted set of --val, one character an image ("1":
# correct) in the set's order, by "corruption-severity": what an interval over the images resamples.
PER_IMAGE_FILE = "per-image.json"
UNSCORED = ("workers", "batch_size")  # settings that do not change a figure: left out of the result
# AlexNet's ImageNet-C top-1 errors, the mean over the five severities of each corruption, as published with
# the benchmark (Hendrycks & Dietterich 2019, github.com/hendrycks/robustness, ImageNet-C/test.py).
ALEXNET_ERRORS = dict(zip(CORRUPTIONS, (
    0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360, 0.866816, 0.826572, 0.819324,
    0.564592, 0.853204, 0.646056, 0.717840, 0.606500), strict=True))


@dataclass(frozen=True)
class RobustnessConfig:
    """Options of `relicv2 eval robustness` (presets in `evaluation/presets/robustness/`)."""

    corruptions: tuple[str, ...] = CORRUPTIONS
    severities: tuple[int, ...] = SEVERITIES
    seed: int = 0  # of the corruptions' randomness (each image's seed derives from it)
    quality: int = 85  # JPEG quality of the stored corrupted views (ImageNet-C's)
    workers: int = 1  # processes corrupting images
    batch_size: int = 256  # images per forward pass of the frozen encoder

    def __post_init__(self) -> None:
        if not self.corruptions or not self.severities:
            raise ConfigError("robustness: corruptions and severities must each name at least one")
        for corruption in self.corruptions:
            for severity in self.severities:
                try:
                    check_corruption(corruption, severity)
                except ValueError as error:
                    raise ConfigError(f"robustness: {error}") from None
        if len(set(self.corruptions)) < len(self.corruptions) or len(set(self.severities)) < len(self.severities):
            raise ConfigError("robustness: a corruption or severity is named twice")
        if not 1 <= self.quality <= 100 or self.workers < 1 or self.batch_size < 1:
            raise ConfigError("robustness: quality must be within 1..100, workers and batch_size positive")


def load_robustness_config(config: str | Path = "full", overrides: tuple[str, ...] = ()) -> RobustnessConfig:
    return resolve(RobustnessConfig, config, overrides, PRESETS)


@dataclass(frozen=True)
class RobustnessJob:
    backbone: Backbone
    head: Path
    output: Path
    config: RobustnessConfig = RobustnessConfig()
    val: Path | None = None  # labelled val set (shard set or class folders) to corrupt
    imagenet_c: Path | None = None  # the released ImageNet-C
    ood: tuple[tuple[str, Path], ...] = ()  # (set name, folder)
    control: Backbone | None = None  # the baseline of generated sets' CE, with its head
    control_head: Path | None = None
    json_path: Path | None = None
    device: str = "auto"


@dataclass(frozen=True)
class Model:
    """An encoder with its head, as scored."""

    encoder: nn.Module
    head: TrainedHead
    name: str


def _model(backbone: Backbone, head_path: Path, device: str) -> Model:
    encoder, record = load_encoder(backbone)
    head = load_head(head_path)
    name = record["checkpoint"] or backbone.describe()
    head.check_encoder(encoder, name)
    return Model(encoder.to(device).eval(), head, name)


class Scores:
    """Each (model, set)'s score, cached as JSON in `results/` under the identity of both."""

    def __init__(self, output: Path, device: str, batch_size: int) -> None:
        self.folder, self.device, self.batch_size = output / "results", device, batch_size

    def top1(self, model: Model, name: str, shards: ShardSet, *, stored_views: bool,
             classes: list[list[int]] | None = None) -> dict[str, Any]:
        head_bytes = Path(model.head.path).read_bytes() if model.head.path else b""
        identity = {"encoder": encoder_digest(model.encoder), "head": hashlib.sha256(head_bytes).hexdigest(),
                    "set": shard_set_fingerprint(shards), "stored_views": stored_views, "targets": classes}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        path = self.folder / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{key}.json"
        if path.is_file():
            try:
                cached = json.loads(path.read_text())
                if "correct" in cached:  # (a score cached before the per-image vector was kept: scored again)
                    return cached
            except (OSError, json.JSONDecodeError):
                pass  # scored again
        crop = model.head.crop_size
        scored = score_head(model.head, model.encoder, shards, targets=classes, device=self.device,
                            crop_size=crop, resize_size=crop if stored_views else None,
                            batch_size=self.batch_size, encoder_name=model.name, progress=True)
        result = {"top1": figure(scored.top1), "num_images": scored.num_images,
                  "skipped": len(scored.skipped_keys), "correct": "".join("01"[c] for c in scored.correct.tolist())}
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(result).encode())
        return result


def corruption_table(top1: dict[str, dict[int, float]], baseline: dict[str, float | None] | None) -> dict[str, Any]:
    """Per corruption: top-1 by severity, its mean and CE against `baseline` (the summed error of the same
    severities, by corruption; None: no CE); the mean over corruptions (the paper's IN-C) and the mCE."""
    rows: dict[str, Any] = {}
    for corruption, by_severity in top1.items():
        errors = sum(1 - value for value in by_severity.values())
        base = baseline.get(corruption) if baseline else None
        rows[corruption] = {"top1": {str(s): figure(v) for s, v in by_severity.items()},
                            "mean_top1": figure(sum(by_severity.values()) / len(by_severity)),
                            "ce": figure(errors / base) if base else None}
    ces = [row["ce"] for row in rows.values()]
    return {"corruptions": rows, "mean_top1": figure(sum(r["mean_top1"] for r in rows.values()) / len(rows)),
            "mce": figure(sum(ces) / len(ces)) if all(ce is not None for ce in ces) else None}


def run_robustness(job: RobustnessJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) the job; the result (also written to `output/robustness.json` and `json_path`).
    Errors a user can cause raise ValueError subclasses (one line each)."""
    if job.val is None and job.imagenet_c is None and not job.ood:
        raise ConfigError("give at least one set to score: --val, --imagenet-c or --ood NAME=FOLDER")
    if (job.control is None) != (job.control_head is None):
        raise ConfigError("the control needs both an encoder (--control-checkpoint or --control-random-init) and "
                          "its head (--control-head)")
    check_outputs(job.output, job.json_path)
    config, device = job.config, resolve_device(job.device, "--device")
    with folder_lock(job.output, "relicv2 eval robustness"):
        model = _model(job.backbone, job.head, device)
        control = _model(job.control, job.control_head, device) if job.control is not None else None
        # Every set's layout and classes checked before hours of work on the first.
        roots = {name: image_folder(name, folder) for name, folder in job.ood}
        wnids = head_wnids(model.head.classes, model.head.num_classes, job.head) if job.ood else []
        if job.imagenet_c is not None:
            _released_folders(job.imagenet_c, config)
        inputs = {"backbone": job.backbone.as_dict(), "head": str(job.head), "val": job.val and str(job.val),
                  "imagenet_c": job.imagenet_c and str(job.imagenet_c), "ood": {n: str(f) for n, f in job.ood},
                  "control": control and {**job.control.as_dict(), "head": str(job.control_head)}}
        save_settings(job.output, config, inputs, log)
        scores = Scores(job.output, device, config.batch_size)
        grid = [(c, s) for c in config.corruptions for s in config.severities]
        result: dict[str, Any] = {"encoder": model.name, "head": str(job.head), "protocol": model.head.protocol,
                                  "config": {k: v for k, v in to_dict(config).items() if k not in UNSCORED},
                                  "control": control and control.name}
        total = len(grid) * ((job.val is not None) + (job.imagenet_c is not None)) + len(job.ood)
        per_image: dict[str, str] = {}
        with Phase("eval robustness: sets", total, unit="set") as sets:
            if job.val is not None:
                result["corrupted"] = _generated(job, model, control, scores, grid, sets, per_image)
            if job.imagenet_c is not None:
                result["imagenet_c"] = _released(job, model, scores, grid, sets)
            result["ood"] = {}
            for name, folder in job.ood:
                shards = shards_of(roots[name], job.output / "ood" / name, COMMAND)
                classes = targets(name, class_names(shards) or [], wnids, folder)
                result["ood"][name] = {"folder": str(folder), "classes": sum(map(bool, classes)),
                                       **scores.top1(model, f"ood-{name}", shards, stored_views=False, classes=classes)}
                sets.update(1)
    if per_image:
        atomic_write_bytes(job.output / PER_IMAGE_FILE, (json.dumps({"corrupted": per_image}) + "\n").encode())
    write_json(result, (job.output / RESULT_FILE, "--output"), (job.json_path, "--json"))
    return result


def _generated(job: RobustnessJob, model: Model, control: Model | None, scores: Scores,
               grid: list[tuple[str, int]], sets: Phase, per_image: dict[str, str]) -> dict[str, Any]:
    """The corrupted copies of --val, generated into `corrupted/`, scored by the model (and the control);
    `per_image` receives the model's correct answers per set (`Scores.top1`'s "correct")."""
    assert job.val is not None
    val = shards_of(job.val, job.output / "val-shards", COMMAND)
    model.head.check_classes(class_names(val), job.val)  # before hours of corrupting
    head = model.head
    if head.crop_size < MIN_SIDE:
        raise CorruptionError(f"the head {job.head} takes {head.crop_size} px views; the corruptions need at least "
                              f"{MIN_SIDE} px: train a head with a larger crop_size")
    top1: dict[str, dict[int, float]] = {}
    control_errors: dict[str, float] = {}
    counts = set()
    with corruption_pool(job.config.workers) as pool:  # one pool for every set: spawned workers start in seconds
        for corruption, severity in grid:
            spec = CorruptionSpec(corruption, severity, job.config.seed, head.crop_size, head.resize_size,
                                  job.config.quality)
            out = job.output / "corrupted" / f"{corruption}-{severity}"
            corrupt_shard_set(val, out, spec, workers=job.config.workers, pool=pool)
            shards = resolve_shard_set(out)
            scored = scores.top1(model, f"{corruption}-{severity}", shards, stored_views=True)
            top1.setdefault(corruption, {})[severity] = scored["top1"]
            counts.add(scored["num_images"])
            per_image[f"{corruption}-{severity}"] = scored["correct"]
            if control is not None:
                # Named by the set alone, as the model's: the cache key holds the encoder and head, so a control
                # scored earlier as an encoder of its own (the control arm of a grid) is read, not scored again.
                base = scores.top1(control, f"{corruption}-{severity}", shards, stored_views=True)
                control_errors[corruption] = control_errors.get(corruption, 0.0) + 1 - base["top1"]
            sets.update(1)
    table = corruption_table(top1, control_errors if control is not None else None)
    return {"source": str(job.val), "images": max(counts), "baseline": control and control.name, **table}


def _released_folders(root: Path, config: RobustnessConfig) -> list[Path]:
    """The released ImageNet-C's folder of each chosen corruption and severity; FileNotFoundError naming the
    first that is missing."""
    folders = [root / c / str(s) for c in config.corruptions for s in config.severities]
    missing = next((f for f in folders if not f.is_dir()), None)
    if missing is not None:
        raise FileNotFoundError(f"{root} has no folder {missing.relative_to(root)}: give the released ImageNet-C "
                                "folder (corruption/severity/class/image), or choose the corruptions and severities "
                                "it holds with --set")
    return folders


def _released(job: RobustnessJob, model: Model, scores: Scores, grid: list[tuple[str, int]],
              sets: Phase) -> dict[str, Any]:
    """The released ImageNet-C folders (`corruption/severity/class/image`), built into `imagenet-c/`."""
    assert job.imagenet_c is not None
    top1: dict[str, dict[int, float]] = {}
    for (corruption, severity), folder in zip(grid, _released_folders(job.imagenet_c, job.config), strict=True):
        shards = shards_of(folder, job.output / "imagenet-c" / f"{corruption}-{severity}", COMMAND)
        model.head.check_classes(class_names(shards), folder)
        top1.setdefault(corruption, {})[severity] = scores.top1(model, f"imagenet-c-{corruption}-{severity}", shards,
                                                                stored_views=True)["top1"]
        sets.update(1)
    # AlexNet's errors are means over all five severities: a CE only when all five were scored.
    full = set(job.config.severities) == set(SEVERITIES)
    baseline = {c: ALEXNET_ERRORS[c] * len(SEVERITIES) for c in top1} if full else None
    return {"source": str(job.imagenet_c), "baseline": "AlexNet (published)" if full else None,
            **corruption_table(top1, baseline)}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The result as the command prints it: one table per corruption set, then the OOD rows."""
    lines = [f"robustness of {result['encoder']} with head {result['head']}"]
    for key, title in (("corrupted", "corrupted copies of"), ("imagenet_c", "ImageNet-C at")):
        if key not in result:
            continue
        part = result[key]
        severities = list(next(iter(part["corruptions"].values()))["top1"])
        lines += ["", f"{title} {part['source']} (top-1)",
                  f"{'corruption':<18}" + "".join(f"{'s' + s:>7}" for s in severities) + f"{'mean':>7}{'CE':>7}"]
        for corruption, row in part["corruptions"].items():
            ce = "-" if row["ce"] is None else f"{row['ce']:.3f}"
            lines.append(f"{corruption:<18}" + "".join(f"{row['top1'][s]:>7.3f}" for s in severities)
                         + f"{row['mean_top1']:>7.3f}{ce:>7}")
        mce = "-" if part["mce"] is None else f"{part['mce']:.3f} (baseline: {part['baseline']})"
        lines.append(f"mean over corruptions (IN-C) {part['mean_top1']:.4f}, mCE {mce}")
    for name, row in result.get("ood", {}).items():
        lines.append(f"{name}: top-1 {row['top1']:.4f} ({row['num_images']} images, {row['classes']} classes)")
    return lines


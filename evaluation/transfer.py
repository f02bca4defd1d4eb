"""`relicv2 eval transfer`: the paper's transfer protocol (appendix "Transfer", after SimCLR and BYOL) on any
labelled set given as train / val / test shard sets (a folder of class sub-folders is built into shards in the
output folder first). A set without a val split gets a seeded share of each class of train as val.

- linear (the default): features of the frozen encoder taken once on the test view (the feature cache,
  `evaluation.features`), standardised, then an l2-regularised multinomial logistic regression (L-BFGS,
  scikit-learn) for each penalty of a log grid, scored on val; the best one refitted on train + val and
  scored on test;
- `--finetune`: encoder and a new head trained through the one supervised loop (`finetune.finetune_samples`)
  for each learning rate x weight decay of a small grid, scored on val; the best retrained on train + val and
  scored on test.

The metric the sweep maximises and the test reports is top-1 or the mean per-class accuracy (`metric`). Each
swept point's figures, and the final one's, are cached in `points/` under the identity of the encoder, the
sets and the settings that shape them, so an interrupted run resumes to the same `transfer.json`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits
from torch import Tensor, nn

from relicv2.evaluation.features import (
    FeatureSet,
    FeatureSpec,
    cached_features,
    encoder_digest,
    shard_set_fingerprint,
)
from relicv2.evaluation.finetune import FinetuneConfig, finetune_samples
from relicv2.evaluation.job import Backbone, check_outputs, load_encoder, save_settings, write_json
from relicv2.evaluation.supervised import LinearResult, accuracy_report
from relicv2.evaluation.views import class_count, labelled_samples
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.config import ConfigError, Presets, resolve, to_dict
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.pretrain.knn import classes
from relicv2.pretrain.knn.classify import at_trained_size, shared_tars
from relicv2.pretrain.knn.outcome import figure
from relicv2.pretrain.views.config import FULL_CROP_SCALE, IMAGE_SIZE, resize_of
from relicv2.shards.build import shards_of
from relicv2.shards.sample_table import SampleTable
from relicv2.shards.shardset import ShardSet
from relicv2.shards.subset import class_balanced_keys, keys_and_labels

COMMAND = "relicv2 eval transfer"
PRESETS = Presets(job=COMMAND, package="relicv2.evaluation", folder="presets/transfer")
RESULT_FILE = "transfer.json"
METRICS = ("top1", "mean_per_class")
# The settings that shape a fine-tuning point's figures besides its lr and weight decay (in its name)
FINETUNE_SHAPING = ("seed", "crop_size", "resize_size", "epochs", "batch_size", "momentum", "crop_scale")


@dataclass(frozen=True)
class TransferConfig:
    """Options of `relicv2 eval transfer` (presets `paper` and `fast` in `evaluation/presets/transfer/`)."""

    # What the sweep maximises on val and the test reports: top1, or mean_per_class (the paper's figure for
    # Aircraft, Pets, Caltech-101 and Flowers; top1 for Food101, CIFAR-10/100, Birdsnap, SUN397, Cars, DTD)
    metric: str = "top1"
    val_fraction: float = 0.2  # without --val: this share of each class of --train is held out as val
    seed: int = 0  # of the carved val split, the heads' initialisation and the fine-tuning views
    crop_size: int = IMAGE_SIZE  # the views' side; follows the encoder's training unless set
    resize_size: int = resize_of(IMAGE_SIZE)  # test views: short side before the centre crop; 0: crop_size / 0.875
    # Linear: the l2 penalty on the mean cross-entropy, l2 / 2 * |W|^2, swept on a log grid, largest first
    l2_min: float = 1e-6  # the weakest penalty swept (the last point)
    l2_max: float = 1e5  # the strongest penalty swept (the first point)
    l2_points: int = 45  # log-spaced penalties from l2_max to l2_min (SimCLR's grid: 45 in [1e-6, 1e5])
    max_iter: int = 1000  # L-BFGS iterations per fit
    feature_batch: int = 256  # images per forward pass of the frozen encoder
    # --finetune: SGD (Nesterov) on encoder and head, one lr for both, x0.2 at 60% and 80% of the epochs
    epochs: int = 100  # of each fine-tuning run
    batch_size: int = 256  # the learning rates are taken as they are at this batch
    learning_rates: tuple[float, ...] = (0.01, 0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 1.0, 2.0)  # swept: the paper's
    weight_decays: tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.1)  # swept with each lr: the paper's
    momentum: float = 0.9
    crop_scale: tuple[float, float] = FULL_CROP_SCALE  # train views of fine-tuning
    workers: int = 2  # decoding worker processes of fine-tuning (0: in the main process)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"transfer: metric must be one of {list(METRICS)}, got {self.metric!r}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"transfer: val_fraction must be within (0, 1), got {self.val_fraction}")
        if not 0 < self.l2_min <= self.l2_max or self.l2_points < 1 or self.max_iter < 1:
            raise ConfigError("transfer: need 0 < l2_min <= l2_max, and l2_points and max_iter positive")
        if not self.learning_rates or not self.weight_decays or min(self.learning_rates) <= 0 \
                or min(self.weight_decays) < 0:
            raise ConfigError("transfer: learning_rates (> 0) and weight_decays (>= 0) must each list a value")
        for name in ("epochs", "batch_size", "crop_size", "feature_batch", "workers"):
            if getattr(self, name) < (0 if name == "workers" else 1):
                raise ConfigError(f"transfer: {name} must be positive (workers may be 0), got {getattr(self, name)}")

    def l2_grid(self) -> list[float]:
        """The swept penalties, strongest first (a tie on val goes to the earlier point)."""
        return [float(v) for v in np.geomspace(self.l2_max, self.l2_min, self.l2_points)]

    def finetune_config(self, lr: float, weight_decay: float) -> FinetuneConfig:
        """One swept point as the fine-tuning protocol's settings (no batch scaling of the lr)."""
        return FinetuneConfig(preset="transfer", epochs=self.epochs, milestones=(0.6 * self.epochs, 0.8 * self.epochs),
                              batch_size=self.batch_size, head_lr=lr, encoder_lr=lr, reference_batch=self.batch_size,
                              weight_decay=weight_decay, momentum=self.momentum, crop_size=self.crop_size,
                              resize_size=self.resize_size, crop_scale=self.crop_scale, seed=self.seed,
                              workers=self.workers)


def load_transfer_config(config: str | Path = "paper", overrides: tuple[str, ...] = ()) -> TransferConfig:
    return resolve(TransferConfig, config, overrides, PRESETS)


@dataclass(frozen=True)
class Splits:
    """The three sets; `val` None: val is carved from train (`val_keys`, the rest `train_keys`)."""

    train: ShardSet
    val: ShardSet | None
    test: ShardSet
    train_keys: set[str] | None = None
    val_keys: set[str] | None = None


def carve_val(train: ShardSet, fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """(train keys, val keys): `fraction` of each class of `train` (rounded, at least one), drawn with `seed`."""
    val = set(class_balanced_keys(train, fraction, seed=seed).keys)
    return {key for key, _ in keys_and_labels(train)[0]} - val, val


def open_splits(train: Path, val: Path | None, test: Path, output: Path, config: TransferConfig) -> Splits:
    """The sets (folders built into shards under `output`), their class names checked alike."""
    sets = {name: shards_of(Path(path), output / "shards" / name, COMMAND) if path is not None else None
            for name, path in (("train", train), ("val", val), ("test", test))}
    for name in ("val", "test"):
        if sets[name] is not None:
            classes.check_same_classes(sets["train"], sets[name])
            if both := shared_tars(sets["train"], sets[name]):
                raise ValueError(f"--train and --{name} share {len(both)} tar(s) ({both[0].name}, ...): give a "
                                 f"held-out {name} set")
    if sets["val"] is not None:
        return Splits(sets["train"], sets["val"], sets["test"])
    train_keys, val_keys = carve_val(sets["train"], config.val_fraction, config.seed)
    return Splits(sets["train"], None, sets["test"], train_keys, val_keys)


def scores(logits: Tensor, labels: Tensor, num_classes: int) -> dict[str, Any]:
    """top-1, top-5 (None under 5 classes), the mean per-class accuracy (over the classes present) and each
    class's accuracy."""
    top1, top5, per_class = accuracy_report(logits, labels, num_classes)
    return _figures(top1, top5, per_class)


def _figures(top1: float, top5: float | None, per_class: dict[int, float]) -> dict[str, Any]:
    return {"top1": figure(top1), "top5": figure(top5), "mean_per_class": figure(sum(per_class.values()) / len(per_class)),
            "per_class": {str(k): figure(v) for k, v in sorted(per_class.items())}}


class Points:
    """Each swept point's figures, cached as JSON in `folder` under the identity of what shapes them."""

    def __init__(self, folder: Path, identity: dict[str, Any]) -> None:
        self.folder = folder
        self.key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def path(self, name: str, suffix: str = ".json") -> Path:
        return self.folder / f"{re.sub(r'[^A-Za-z0-9_.=,-]+', '_', name)}-{self.key}{suffix}"

    def get(self, name: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        path = self.path(name)
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, dict) and all(isinstance(cached.get(m), float) for m in METRICS):
                return cached
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass  # computed again
        text = json.dumps(compute(), sort_keys=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (text + "\n").encode())
        return json.loads(text)  # as a resumed run reads it


def point_name(point: dict[str, float], prefix: str = "") -> str:
    return prefix + ",".join(f"{k}={v:.6g}" for k, v in point.items())


def sweep(grid: list[dict[str, float]], on_val: Callable[[dict[str, float]], dict[str, Any]],
          on_test: Callable[[dict[str, float]], dict[str, Any]], metric: str, points: Points) -> dict[str, Any]:
    """Score every point of `grid` on val (`on_val`), choose the best by `metric` (ties: the earlier point),
    and score only that one on test (`on_test`: retrained on train + val)."""
    progress = Phase("transfer sweep", len(grid) + 1, unit="point")
    swept = []
    for point in grid:
        swept.append({**point, "val": points.get(point_name(point), lambda p=point: on_val(p))})
        progress.update(1)
    best = max(range(len(swept)), key=lambda i: (swept[i]["val"][metric], -i))
    chosen = grid[best]
    test = points.get(point_name(chosen, "final,"), lambda: on_test(chosen))
    progress.update(1)
    progress.close()
    return {"swept": swept, "chosen": chosen, "val": swept[best]["val"], "test": test, "test_metric": test[metric]}


def _rows(features: FeatureSet, keys: set[str] | None) -> tuple[Tensor, Tensor]:
    if keys is None:
        return features.features, features.labels
    chosen = torch.tensor([key in keys for key in features.keys], dtype=torch.bool)
    return features.features[chosen], features.labels[chosen]


def fit_logistic(features: Tensor, labels: Tensor, l2: float, max_iter: int) -> Callable[[Tensor, int], Tensor]:
    """An l2-regularised multinomial logistic regression (L-BFGS) on standardised `features`: minimises the
    mean cross-entropy + l2 / 2 * |W|^2 (scikit-learn's C = 1 / (l2 * n); the bias is not penalised).
    Returns logits(features, num_classes): -inf for a class the fit never saw."""
    x = features.double().numpy()
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    if len(np.unique(labels.numpy())) < 2:
        raise ValueError("the training split holds a single class: a classifier needs two or more")
    model = LogisticRegression(C=1.0 / (l2 * len(x)), solver="lbfgs", max_iter=max_iter)
    # One BLAS / OpenMP thread: beside torch's own pools the default ones contend (30x slower per iteration on
    # a 2-core box, benchmarks/RESULTS.md "Transfer").
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)  # a fit that stops at max_iter is still a fit
        model.fit((x - mean) / std, labels.numpy())

    def logits(rows: Tensor, num_classes: int) -> Tensor:
        out = torch.full((len(rows), num_classes), -math.inf, dtype=torch.float64)
        with threadpool_limits(1):
            scored = model.predict_log_proba((rows.double().numpy() - mean) / std)
        out[:, torch.as_tensor(model.classes_)] = torch.from_numpy(scored)
        return out
    return logits


def linear_transfer(encoder: nn.Module, splits: Splits, config: TransferConfig, *, output: Path,
                    device: str = "cpu", identity: dict[str, Any]) -> dict[str, Any]:
    """The linear sweep on cached features; its result (see `sweep`) with the split sizes."""
    encoder = encoder.to(device).eval().requires_grad_(False)
    spec = FeatureSpec(crop_size=config.crop_size, resize_size=config.resize_size, batch_size=config.feature_batch)
    feats = {name: cached_features(encoder, source, spec, cache_dir=output / "features", device=device, progress=True)
             for name, source in (("train", splits.train), ("val", splits.val), ("test", splits.test)) if source}
    train = _rows(feats["train"], splits.train_keys)
    val = _rows(feats["val"], None) if splits.val is not None else _rows(feats["train"], splits.val_keys)
    test = feats["test"].features, feats["test"].labels
    num_classes = classes.class_count((splits.train, train[1]), (splits.val or splits.train, val[1]),
                                      (splits.test, test[1]))

    points = Points(output / "points", {**identity, "protocol": "linear", "spec": asdict(spec),
                                        "max_iter": config.max_iter})
    skipped = sorted({key for f in feats.values() for key in f.skipped_keys})
    return {**linear_sweep(train, val, test, num_classes, config, points), "skipped_keys": skipped}


Rows = tuple[Tensor, Tensor]  # features, labels


def linear_sweep(train: Rows, val: Rows, test: Rows, num_classes: int, config: TransferConfig,
                 points: Points) -> dict[str, Any]:
    """The l2 grid fitted on `train`, scored on `val`; the chosen penalty refitted on train + val, scored on
    `test` (see `sweep`), with the split sizes."""
    def fit_and_score(fit: Rows, scored: Rows, l2: float) -> dict[str, Any]:
        logits = fit_logistic(*fit, l2=l2, max_iter=config.max_iter)
        return scores(logits(scored[0], num_classes), scored[1], num_classes)

    both = torch.cat([train[0], val[0]]), torch.cat([train[1], val[1]])
    result = sweep([{"l2": l2} for l2 in config.l2_grid()], lambda p: fit_and_score(train, val, p["l2"]),
                   lambda p: fit_and_score(both, test, p["l2"]), config.metric, points)
    return {**result, "num_train": len(train[1]), "num_val": len(val[1]), "num_test": len(test[1]),
            "num_train_final": len(both[1])}


def finetune_transfer(encoder: nn.Module, splits: Splits, config: TransferConfig, *, output: Path,
                      device: str = "cpu", identity: dict[str, Any]) -> dict[str, Any]:
    """The fine-tuning sweep: a fresh copy of `encoder` per point; its result (see `sweep`) with the sizes."""
    train = labelled_samples(splits.train, splits.train_keys)
    val = labelled_samples(splits.val) if splits.val is not None else labelled_samples(splits.train, splits.val_keys)
    test = labelled_samples(splits.test)
    both = SampleTable.from_refs([*train[0], *val[0]]), train[1] | val[1]
    num_classes = class_count((train[0], splits.train), (val[0], splits.val or splits.train), (test[0], splits.test))
    points = Points(output / "points", {**identity, "protocol": "finetune"})

    def run(fit: tuple[Any, set[str]], scored: tuple[Any, set[str]], point: dict[str, float], final: str) -> dict:
        settings = config.finetune_config(point["lr"], point["wd"])
        state = points.path(point_name(point, final), ".pt")
        result: LinearResult = finetune_samples(copy.deepcopy(encoder), fit, scored, num_classes, settings,
                                                device=device, state_path=state)
        state.unlink(missing_ok=True)  # the figures are kept; the weights of a swept point are not
        return _figures(result.top1, result.top5, result.per_class_top1)

    grid = [{"lr": lr, "wd": wd} for lr in config.learning_rates for wd in config.weight_decays]
    result = sweep(grid, lambda p: run(train, val, p, ""), lambda p: run(both, test, p, "final,"), config.metric,
                   points)
    return {**result, "num_train": len(train[0]), "num_val": len(val[0]), "num_test": len(test[0]),
            "num_train_final": len(both[0]), "skipped_keys": sorted(train[1] | val[1] | test[1])}


@dataclass(frozen=True)
class TransferJob:
    backbone: Backbone
    train: Path
    test: Path
    output: Path
    val: Path | None = None
    config: TransferConfig = TransferConfig()
    finetune: bool = False
    json_path: Path | None = None
    device: str = "auto"
    given: frozenset[str] = frozenset()  # settings the user gave (the others may follow the encoder's training)


def run_transfer(job: TransferJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) the job; the result (also `output/transfer.json` and `json_path`). Errors a user can
    cause raise ValueError subclasses (one line each)."""
    check_outputs(job.output, job.json_path)
    device = resolve_device(job.device, "--device")
    with folder_lock(job.output, COMMAND):
        encoder, record = load_encoder(job.backbone)
        config = at_trained_size(job.config, record["trained_protocol"], job.given)
        inputs = {"backbone": job.backbone.as_dict(), "train": str(job.train), "test": str(job.test),
                  "val": None if job.val is None else str(job.val), "finetune": job.finetune}
        save_settings(job.output, config, inputs, log)
        splits = open_splits(job.train, job.val, job.test, job.output, config)
        carved = splits.val is None
        identity = {"encoder": encoder_digest(encoder), "seed": config.seed,
                    "sets": [shard_set_fingerprint(s) if s is not None else None
                             for s in (splits.train, splits.val, splits.test)],
                    "carved": [config.val_fraction, config.seed] if carved else None}
        evaluate = finetune_transfer if job.finetune else linear_transfer
        if job.finetune:
            identity["settings"] = {k: v for k, v in to_dict(config).items() if k in FINETUNE_SHAPING}
        result = evaluate(encoder, splits, config, output=job.output, device=device, identity=identity)
    payload = {"protocol": f"transfer-{'finetune' if job.finetune else 'linear'}", "metric": config.metric,
               "checkpoint": record["checkpoint"], "random_init": job.backbone.random_depth,
               "network": record["network"], "step": record["step"], "inputs": inputs,
               "val_split": (f"carved: {config.val_fraction:g} of each class of train, seed {config.seed}"
                             if carved else "given"), **result, "config": to_dict(config)}
    write_json(payload, (job.output / RESULT_FILE, "--output"), (job.json_path, "--json"))
    return payload


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What the command prints: the chosen point and the test figures."""
    chosen = ", ".join(f"{k}={v:g}" for k, v in result["chosen"].items())
    test = result["test"]
    return [f"{result['protocol']} of {result['checkpoint'] or 'random-init ResNet-' + str(result['random_init'])}: "
            f"chosen {chosen} ({result['metric']} on val {result['val'][result['metric']]:.4f}, "
            f"{len(result['swept'])} points swept)",
            f"test ({result['num_test']} images, trained on {result['num_train_final']} = train + val): "
            f"top-1 {test['top1']:.4f}, mean per-class {test['mean_per_class']:.4f}"]

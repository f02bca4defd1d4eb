"""Reading what the jobs wrote: a pretraining run's metrics.jsonl and config.yaml, the eval commands'
`--json` files, `saliency train`'s report.json, handcrafted maps and (masked) shard samples.

Every reader tolerates what a killed or foreign job leaves behind: a malformed line or file is
counted and named in `problems`, never raised, so a report can always be written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from relicv2.jobs.config import SETTINGS_FILE, load_yaml
from relicv2.shards.images import ImageLoadError, load_gray, load_rgb, read_bytes
from relicv2.shards.keys import UnsafeKeyError, safe_relative_path
from relicv2.shards.limits import DEFAULT_LIMITS
from relicv2.shards.reader import json_problem
from relicv2.shards.sample import MASK_MEMBER

EVAL_REQUIRED = ("protocol", "top1")  # the eval `--json` contract: at least these keys


@dataclass
class RunMetrics:
    """Step records (loss parts, lr, ...) and kNN records of one pretraining run, one per step."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    knn: list[dict[str, Any]] = field(default_factory=list)  # each with "epoch" and "knn_top1"
    problems: list[str] = field(default_factory=list)
    # The settings the run was started with (its config.yaml), e.g. config["knn"], config["views"].
    config: dict[str, Any] = field(default_factory=dict)

    def masked_per_epoch(self) -> list[tuple[int, float]]:
        """(epoch, fraction of large views masked) from the step records, each record weighted by the
        steps it covers; empty when the run logged no masking (generated data, older runs)."""
        totals: dict[int, list[float]] = {}
        previous = 0
        for record in self.steps:
            if isinstance(record.get("masked_fraction"), int | float) and isinstance(record.get("epoch"), int | float):
                epoch = max(1, math.ceil(record["epoch"] - 1e-9))  # a record at an epoch's end belongs to it
                total = totals.setdefault(epoch, [0.0, 0.0])
                steps = record["step"] - previous
                total[0], total[1] = total[0] + record["masked_fraction"] * steps, total[1] + steps
            previous = record["step"]
        return [(epoch, masked / steps) for epoch, (masked, steps) in sorted(totals.items()) if steps]


def read_run_metrics(run_dir: Path) -> RunMetrics:
    """Parse `run_dir/metrics.jsonl`. A resumed run re-logs the steps after its checkpoint: the last
    record of a step wins. kNN records get an "epoch" from the run's steps per epoch when they lack one."""
    result = RunMetrics()
    path = Path(run_dir) / "metrics.jsonl"
    steps: dict[int, dict[str, Any]] = {}
    knn: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = load_json(line)
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):
            result.problems.append(f"{path}:{number}: not a metrics record, skipped")
            continue
        if "knn_top1" in record:
            knn[step] = record
        if "loss" in record:
            steps[step] = record
    result.steps = [steps[s] for s in sorted(steps)]
    try:
        config = load_yaml((Path(run_dir) / SETTINGS_FILE).read_text(), SETTINGS_FILE)
    except (OSError, ValueError, yaml.YAMLError):  # absent, unreadable or hostile: no settings
        config = {}
    result.config = config if isinstance(config, dict) else {}
    try:  # from the derived values saved in config.yaml, else from the step records' epoch/step ratio
        steps_per_epoch = float(result.config["derived"]["steps_per_epoch"])
    except (KeyError, TypeError, ValueError):
        steps_per_epoch = next((r["step"] / r["epoch"] for r in result.steps
                                if isinstance(r.get("epoch"), int | float) and r["epoch"] > 0), None)
    # A record's own epoch, when it has one, wins over the one computed here.
    result.knn = [{"epoch": step / steps_per_epoch, **knn[step]} if steps_per_epoch else knn[step]
                  for step in sorted(knn)]
    return result


@dataclass(frozen=True)
class EvalResult:
    """One `--json` file of an eval command (the contract's fields the report shows)."""

    path: Path
    protocol: str
    encoder: str  # "random init ResNet-18" or the checkpoint's path
    random_init: bool
    top1: float
    top5: float | None
    num_train: int | None
    num_val: int | None
    settings: dict[str, Any] = field(default_factory=dict)  # the protocol's settings (image size, k, bank, ...)


def read_eval_results(paths: list[Path]) -> tuple[list[EvalResult], list[str]]:
    """Load eval JSON files (folders are searched for *.json); bad files are named in the problems."""
    files: list[Path] = []
    for path in paths:
        files += sorted(Path(path).glob("*.json")) if Path(path).is_dir() else [Path(path)]
    files = list({file.resolve(): file for file in files}.values())  # a folder and a file in it: read once
    results, problems = [], []
    for path in files:
        try:
            data = load_json(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or any(key not in data for key in EVAL_REQUIRED):
                raise ValueError(f"needs the keys {', '.join(EVAL_REQUIRED)}")
            top1 = _number(data["top1"], "top1")
            top5 = None if data.get("top5") is None else _number(data["top5"], "top5")
        except (OSError, ValueError, TypeError) as error:
            problems.append(f"{path}: not an eval result ({error}), left out")
            continue
        random_depth = data.get("random_init")
        # The protocol settings an eval JSON records: kNN's `settings`, the trained heads' `config`.
        settings = data.get("settings") if isinstance(data.get("settings"), dict) else data.get("config")
        encoder = (f"random init ResNet-{random_depth}" if random_depth
                   else str(data.get("checkpoint") or "unknown checkpoint"))
        results.append(EvalResult(path=path, protocol=str(data["protocol"]), encoder=encoder,
                                  random_init=bool(random_depth), top1=top1, top5=top5,
                                  num_train=_int_or_none(data.get("num_train")),
                                  num_val=_int_or_none(data.get("num_val")),
                                  settings=settings if isinstance(settings, dict) else {}))
    # Protocols together, the trained encoder before its random-init baseline.
    results.sort(key=lambda r: (r.protocol, r.random_init, r.encoder))
    return results, problems


def protocol_text(settings: dict[str, Any]) -> str:
    """The settings that decide a figure, in a few words: "64 px, k=20, T=0.07, bank train, split val"."""
    size = settings.get("image_size", settings.get("crop_size"))
    parts = [f"{size} px"] if size is not None else []
    shorts = (("k", "k"), ("temperature", "T"), ("epochs", "epochs"), ("batch_size", "batch"))
    parts += [f"{short}={settings[key]}" for key, short in shorts if settings.get(key) is not None]
    parts += [f"{key} {Path(str(settings[key])).name}" for key in ("bank", "split") if settings.get(key)]
    return ", ".join(parts) or "-"


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def metric_rows(report: Any, path: tuple[str, ...] = ()) -> list[tuple[str, dict[str, float]]]:
    """Flatten a nested report (e.g. saliency train's report.json) into (name, {metric: value}) rows:
    every mapping whose values include numbers becomes a row named by its path."""
    rows: list[tuple[str, dict[str, float]]] = []
    if isinstance(report, dict):
        numbers = {str(k): float(v) for k, v in report.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers and path:
            rows.append((" / ".join(path), numbers))
        for key, value in report.items():
            if isinstance(value, dict | list):
                rows += metric_rows(value, (*path, str(key)))
    elif isinstance(report, list):
        for index, value in enumerate(report):
            name = value.get("name") or value.get("method") if isinstance(value, dict) else None
            rows += metric_rows(value, (*path, str(name or index)))
    return rows


def load_json(text: str) -> Any:
    """JSON text a job wrote, as data; ValueError when it is not JSON or nests deeper than the reader's limit
    for metadata (the shard reader's one rule: deep JSON exhausts a stack here and in `metric_rows`)."""
    code, value = json_problem(text.encode("utf-8", "replace"), DEFAULT_LIMITS)
    if code is not None:
        raise ValueError(value)
    return value


def read_json(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, why it could not be read)."""
    try:
        return load_json(Path(path).read_text(encoding="utf-8")), None
    except (OSError, ValueError) as error:
        return None, f"{path}: {error}"


@dataclass
class SaliencySample:
    """One image with whatever saliency outputs exist for it (arrays in [0, 1], image size)."""

    key: str
    image: np.ndarray  # HxWx3 uint8
    maps: dict[str, np.ndarray] = field(default_factory=dict)  # handcrafted method -> map
    mask: np.ndarray | None = None  # the network's soft mask from a masked shard set


def read_saliency_samples(shards: Path, maps_dir: Path | None, count: int) -> tuple[list[SaliencySample], list[str]]:
    """Up to `count` samples of `shards` (a masked or plain shard set), preferring keys that have
    handcrafted maps in `maps_dir`; masks come from `mask.png` members when the set has them."""
    from relicv2.shards import (  # imported here: it pulls in the shard reader
        ReadReport,
        iter_samples,
    )

    problems: list[str] = []
    with_maps: list[SaliencySample] = []
    without: list[SaliencySample] = []
    read = ReadReport()
    # Scan a bounded prefix: on an ImageNet-size set whose keys have no maps, never read it all.
    for scanned, raw in enumerate(iter_samples(shards, report=read)):
        if len(with_maps) >= count or scanned >= max(50 * count, 500):
            break
        try:
            image = load_rgb(raw["image"], f"{raw['shard']}:{raw['key']}")
            size = (image.shape[1], image.shape[0])
            sample = SaliencySample(key=raw["key"], image=image)
            if MASK_MEMBER in raw:
                sample.mask = _grey(load_gray(raw[MASK_MEMBER], f"{raw['shard']}:{raw['key']}.{MASK_MEMBER}"), size)
            sample.maps = _maps_for(maps_dir, raw["key"], size) if maps_dir else {}
        except (ImageLoadError, OSError, ValueError) as error:
            problems.append(f"{shards}: sample {raw.get('key')!r} unreadable ({error}), skipped")
            continue
        (with_maps if sample.maps or not maps_dir else without).append(sample)
    problems += [f"{tar}: {reason}" for tar, reason in read.lost_shards]
    problems += [f"{tar}: {what} skipped ({reason})" for tar, what, reason in read.rejected]
    chosen = (with_maps + without)[:count]
    if maps_dir and chosen and not any(s.maps for s in chosen):
        problems.append(f"no handcrafted map in {maps_dir} matches a key of {shards}")
    return chosen, problems


def _maps_for(maps_dir: Path, key: str, size: tuple[int, int]) -> dict[str, np.ndarray]:
    maps: dict[str, np.ndarray] = {}
    if not Path(maps_dir).is_dir():
        return maps
    # One folder a method (what `relicv2 saliency handcrafted` writes): read from the output, not named here.
    for method in sorted(p.name for p in Path(maps_dir).iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            path = safe_relative_path(Path(maps_dir) / method, key, ".png")
        except UnsafeKeyError:
            return {}  # a hostile key names no file of ours
        if path.is_file():
            maps[method] = _grey(load_gray(read_bytes(path), str(path)), size)
    return maps


def _grey(values: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A uint8 map or mask as float [0, 1] at `size` (width, height), resized bilinearly when it differs."""
    image = Image.fromarray(values)
    if image.size != size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.float32) / 255.0


def read_backgrounds(path: Path, count: int) -> tuple[dict | None, list[tuple[str, dict[str, np.ndarray]]], list[str]]:
    """(the result of `eval backgrounds`, up to `count` images with each of their composites, problems), from
    its output folder or its JSON; the composites from the variant set the JSON names beside it, if there."""
    from relicv2.evaluation.backgrounds import RESULT_FILE, variant_key
    from relicv2.shards.reader import ReadReport, locate_samples
    from relicv2.shards.writer import shard_name

    json_path = Path(path) / RESULT_FILE if Path(path).is_dir() else Path(path)
    result, problem = read_json(json_path)
    if problem is not None or not isinstance(result, dict) or not isinstance(result.get("accuracy"), dict):
        return None, [], [problem or f"{json_path}: not a backgrounds result (no 'accuracy'), left out"]
    folder = json_path.parent / str(result.get("variant_set", ""))
    refs = {}
    try:
        for name in result["accuracy"]:
            if (tar := folder / shard_name(name, 0)).is_file():
                refs[name] = {ref.key: ref for ref in locate_samples(tar, ReadReport())}
        first = next(iter(refs.values()), {})
        sources = [load_json(ref.read("json").decode("utf-8", "replace"))["source"] for ref in list(first.values())[:count]]
        rows = [(source, {name: load_rgb(found[key].read_image(), key) for name, found in refs.items()
                          if (key := variant_key(name, source)) in found}) for source in sources]
    except (OSError, ValueError, KeyError, TypeError) as error:  # a damaged or foreign set: the table alone
        return result, [], [f"{folder}: no example composites ({error})"]
    return result, rows, []

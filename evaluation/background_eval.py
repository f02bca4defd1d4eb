"""`relicv2 eval backgrounds`: the backgrounds test of `evaluation.backgrounds` on any labelled val set with
masks. The variant set is written (or resumed) in OUT/variants (`evaluation.background_set`), at the view the
linear head was trained on; each variant is scored with the frozen encoder and the head (`head_file`), its
score kept in OUT/scores/VARIANT.json so an interrupted run resumes; the result is OUT/backgrounds.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from relicv2.evaluation.background_set import (
    BackgroundsError,
    VariantSettings,
    mask_source,
    plan_variant_set,
    variant_tars,
)
from relicv2.evaluation.backgrounds import (
    MIXED,
    RESULT_FILE,
    VARIANTS,
    bg_gap,
    check_variants,
    follows_background,
)
from relicv2.evaluation.features import shard_set_fingerprint
from relicv2.evaluation.head_file import load_head, score_head
from relicv2.evaluation.job import Backbone, check_outputs, load_encoder, save_settings, write_json
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.config import Presets, resolve, to_dict
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks
from relicv2.pretrain.knn.classes import class_names
from relicv2.shards.driver import run_shard_job
from relicv2.shards.job import digest_of, sha256_of
from relicv2.shards.manifest import read_manifest
from relicv2.shards.outdir import output_folder
from relicv2.shards.shardset import resolve_shard_set

PRESETS = Presets(job="relicv2 eval backgrounds", package="relicv2.evaluation", folder="presets/backgrounds")
VARIANT_DIR = "variants"
SCORES_DIR = "scores"


@dataclass(frozen=True)
class BackgroundsConfig:
    """Options of the backgrounds test (preset `default` in `evaluation/presets/backgrounds/`)."""

    seed: int = 0  # of the pairings
    variants: tuple[str, ...] = VARIANTS  # any of them; mixed_same and mixed_rand give the BG-gap
    images_per_shard: int = 1000  # of the variant set: its unit of resumption
    quality: int = 95  # JPEG quality of the composites
    batch_size: int = 256  # images per forward pass of the frozen encoder

    def __post_init__(self) -> None:
        if self.images_per_shard < 1 or self.batch_size < 1 or not 1 <= self.quality <= 100:
            raise ValueError("images_per_shard and batch_size must be positive, quality within 1..100")
        check_variants(self.variants)


def load_backgrounds_config(config: str | Path = "default", overrides: Sequence[str] = ()) -> BackgroundsConfig:
    """A backgrounds preset or YAML file, with `key=value` overrides."""
    return resolve(BackgroundsConfig, config, overrides, PRESETS)


def _variant_score(encoder: nn.Module, head: Any, out: Path, name: str, config: BackgroundsConfig,
                   device: torch.device, encoder_name: str) -> dict:
    """One variant's score, from OUT/scores/NAME.json when it was taken from these tars with this head."""
    tars = variant_tars(out / VARIANT_DIR, name)
    source = resolve_shard_set(tars)
    made_from = digest_of({"tars": shard_set_fingerprint(source), "head": sha256_of(head.path)})
    path = out / SCORES_DIR / f"{name}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("made_from") == made_from:
            return cached
    except (OSError, ValueError):  # none yet, or cut short: scored again
        pass
    scored = score_head(head, encoder, source, batch_size=config.batch_size, device=device,
                        encoder_name=encoder_name)
    record = {"made_from": made_from, "top1": scored.top1, "images": scored.num_images,
              "skipped": list(scored.skipped_keys), "predictions": scored.predictions.tolist(),
              "labels": scored.labels.tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(record).encode())
    return record


def evaluate_backgrounds(encoder: nn.Module, head_path: Path, val: Path, masks: Path | None, out: Path,
                         config: BackgroundsConfig, *, device: str | torch.device = "cpu", encoder_name: str = "",
                         about: dict | None = None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """The test's result, written to OUT/backgrounds.json after `about` (what the encoder is). Raises
    BackgroundsError and the head file's HeadMismatchError (ValueErrors) for inputs it cannot use, before any
    work."""
    head = load_head(head_path)
    head.check_encoder(encoder, encoder_name or "the given encoder")
    val_set = resolve_shard_set(val)
    head.check_classes(names := class_names(val_set), val)
    settings = VariantSettings(config.seed, head.resize_size, head.crop_size, config.variants,
                               config.images_per_shard, config.quality)
    job, work = plan_variant_set(val_set, mask_source(val_set, masks), out / VARIANT_DIR, settings, classes=names,
                                 progress=progress)
    screened = work.screened
    if (top := int(screened.labels.max())) >= head.num_classes:
        raise BackgroundsError(f"{val} has class index {top}, beyond the {head.num_classes} classes of {head_path}; "
                               "give the val set of the head's classes")
    device = torch.device(device)
    encoder = encoder.to(device).eval().requires_grad_(False)
    with output_folder(out), folder_lock(out, "relicv2 eval backgrounds"):
        save_settings(out, config, {"head": str(head_path), "val": str(val), "masks": masks,
                                    "view": {"side": settings.side, "crop": settings.crop}}, log)
        log(f"{len(screened.refs)} of {len(screened.refs) + len(screened.left_out)} images used, left out "
            f"{screened.excluded or 'none'}")
        report = run_shard_job(job, work, Ranks(), name="eval backgrounds", progress=progress)
        scores = {}
        with Phase("eval backgrounds: scoring", len(config.variants), unit="variant", enabled=progress) as bar:
            for name in config.variants:
                scores[name] = _variant_score(encoder, head, out, name, config, device, encoder_name)
                bar.update(1)
        result = {**(about or {}), **_result(scores, out, config, head, val, masks, work, report)}
        write_json(result, (out / RESULT_FILE, "--output"))
    return result


def _result(scores: dict, out: Path, config: BackgroundsConfig, head: Any, val: Path, masks: Path | None,
            work: Any, report: Any) -> dict:
    screened, settings = work.screened, work.settings
    background = _background_labels(out / VARIANT_DIR)
    accuracy = {name: scores[name]["top1"] for name in config.variants}
    follows = {}
    for name in ("mixed_rand", "mixed_next"):  # (a same-class background has no other class to follow)
        if name in scores:
            keys = [k for k in background[name] if k not in set(scores[name]["skipped"])]
            follows[name] = follows_background(np.array(scores[name]["predictions"]),
                                               np.array(scores[name]["labels"]),
                                               np.array([background[name][k] for k in keys]))
    return {"protocol": "backgrounds", "head": str(head.path), "head_protocol": head.protocol, "val": str(val),
            "masks": None if masks is None else str(masks), "settings": {**to_dict(config), "side": settings.side,
                                                                         "crop": settings.crop},
            "num_val": len(screened.refs) + len(screened.left_out), "images": len(screened.refs),
            "excluded": screened.excluded, "accuracy": accuracy,
            "num_images": {name: scores[name]["images"] for name in config.variants},
            "bg_gap": bg_gap(accuracy) if {"mixed_same", "mixed_rand"} <= set(accuracy) else None,
            "follows_background": follows, "variant_set": VARIANT_DIR,
            "rejected_while_writing": report.merge.rejected - len(screened.left_out) if report.merge else 0}


def _background_labels(variants: Path) -> dict[str, dict[str, int]]:
    """Per mixed variant, {composite key: its background's class} in the set's order."""
    table = read_manifest(variants)
    if "background_label" not in table.column_names:
        return {}
    rows = table.select(["key", "variant", "background_label"]).to_pylist()
    return {name: {r["key"]: r["background_label"] for r in rows if r["variant"] == name} for name in MIXED}


def table_lines(result: dict) -> list[str]:
    """The result as the command prints it."""
    lines = [f"backgrounds test of {result.get('encoder', 'the encoder')} on {result['val']}: "
             f"{result['images']} of {result['num_val']} images used, left out {result['excluded'] or 'none'}"]
    width = max(len(name) for name in result["accuracy"])
    lines += [f"  {name.ljust(width)}  top-1 {top1:.4f}  ({result['num_images'][name]} images)"
              for name, top1 in result["accuracy"].items()]
    if result["bg_gap"] is not None:
        lines.append(f"  BG-gap (mixed_same - mixed_rand)  {result['bg_gap']:+.4f}")
    lines += [f"  {name}: predicted the background's class  {share:.4f}"
              for name, share in result["follows_background"].items()]
    return lines


def run_backgrounds(backbone: Backbone, head: Path, val: Path, masks: Path | None, output: Path,
                    config: BackgroundsConfig, *, json_path: Path | None = None, device: str = "auto",
                    log: Callable[[str], None] = print) -> list[str]:
    """The command: load the encoder, run the test, write OUT/backgrounds.json (and `json_path`); the lines
    to print."""
    check_outputs(output, json_path)
    encoder, record = load_encoder(backbone)
    about = {"encoder": backbone.describe(), "checkpoint": record["checkpoint"], "random_init": backbone.random_depth,
             "network": record["network"]}
    result = evaluate_backgrounds(encoder, head, val, masks, output, config, device=resolve_device(device, "--device"),
                                  encoder_name=backbone.describe(), about=about, log=log)
    write_json(result, (json_path, "--json"))
    return table_lines(result)


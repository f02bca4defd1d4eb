"""Does masking pay? The paper's saliency masking against its controls on Imagenette, one command.

Declared before any run (PRIMARY): the two primary figures are
- the **BG-gap** of `relicv2 eval backgrounds` (mixed_same top-1 less mixed_rand top-1 on the val subset's
  composites, built from the saliency network's masks of the val images): the background reliance the
  masking is meant to remove, so lower is better;
- the **mean IN-C top-1** of `relicv2 eval robustness` (the 15 ImageNet-C corruptions at severities 1, 3
  and 5 of the same val subset, the `quick` preset).
kNN top-1 (`eval knn`, the whole val set) and linear top-1 (`eval linear --config fast`, the whole val set)
are secondary. The paper's own ablations (appendix) predict small effects: p_m 0.1 against 0 gained 0.2-0.3
points of ImageNet linear top-1, random rectangles scored more than a point below saliency masks.

The grid, every stage through the library as the `relicv2` commands run it, each kept in --out and skipped
when done (rerun the same command to resume):
1. `shards build` of DATA/train and DATA/val, and of a fixed class-balanced val subset (--val-images, drawn
   with seed 0 from the val folder's files);
2. the saliency network: `saliency train --config cpu --backbone random --set input_size=SIZE`. The `cpu`
   preset is the project's measured CPU network (1,240 images, one round; RESULTS "The presets"), run at the
   benchmark's image size to fit the budget (64 instead of 112 px cost .016 max-F at 1,240 images, RESULTS
   "Levers: what each bought", T -> V). A random backbone instead of the guide's bootstrap (a first pretraining
   without masks): an Imagenette backbone bought nothing over a random one there (N -> R), and it would cost
   a whole pretraining run. Then `saliency build-masks` of the train set and of the val subset; their
   coverage histograms (`masks-coverage.json`) and preview grids (`masks-train.png`, `masks-val.png`) are
   kept in --out to be looked at;
3. per seed, random masks: each training image's mask replaced by a rectangle of the same area (pixels at
   or above the foreground level) placed uniformly at random (`random_rectangle`, seeded by (seed, key)),
   hard-edged as the paper's, written as a mask shard set in build-masks' format (`random-masks-sSEED/`);
4. per arm and seed, `pretrain --config imagenette-r18-cpu` at the arm's p_m on the arm's masks, run.seed =
   the seed, no kNN monitor, --epochs epochs (the schedule whole: warm-up and cosine over those steps);
5. per encoder, at the views' size (the whole image: crop and resize SIZE, as RESULTS' Imagenette rows):
   `eval knn`, `eval linear --config fast --output` (its head), `eval robustness --config
   quick` on the val subset (with the same seed's control as the CE baseline once it is scored) and `eval
   backgrounds` on the masked val subset. Corrupted sets and composites are made once, in shared folders
   (`robustness/`, `backgrounds/`), and each encoder's scores cached there.
Each encoder's row goes to `rows.jsonl` as it comes (a row already there is not recomputed); the script
ends with the markdown table RESULTS.md holds: mean and spread (sample sd) over seeds per arm, each arm's
paired per-seed difference from the control, and for the primary figures a 95% bootstrap interval over the
val subset's images of that difference (the per-image correctness the scorers keep, averaged over seeds).

Budget: the default grid (4 arms x 3 seeds, masks included) in about 2.5 hours on the quiet 2-core CPU box
(the measured time is in RESULTS "Does masking pay?"). Hence 64 px views and ResNet-18 (the `imagenette-r18-cpu`
preset), one epoch (73 steps of batch 128) an arm, every arm of equal length, and a fixed val subset of 1,000
images for the corruptions and composites. Per arm and seed ~9 min: ~5.7 min of pretraining and ~3 min of scoring
(kNN and the linear probe over the whole val set, 45,000 corrupted images, ~8,000 composites); once, ~11 min for
the saliency network and ~1 min of masks. Each row records its stages' seconds (`rows.jsonl`), the preparation
its own (`prepare-seconds.json`). A GPU turns the same script up: --size, --epochs, --val-images and --pretrain-set.

    python benchmarks/masking_effect.py --out OUT [--data DIR] [--seeds 0,1,2] \\
        [--arms control,pm0.1,pm0.3,random0.1] [--size 64] [--epochs 1] [--val-images 1000]

Arms: `control` (p_m 0), `pmP` (the saliency masks at p_m P), `randomP` (random rectangles at p_m P).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.evaluation.background_eval import load_backgrounds_config, run_backgrounds  # noqa: E402
from relicv2.evaluation.head_file import TRAINED_HEAD_FILE  # noqa: E402
from relicv2.evaluation.job import Backbone, EvalJob, knn_settings, load_linear_config, run_eval  # noqa: E402
from relicv2.evaluation.robustness import (  # noqa: E402
    PER_IMAGE_FILE,
    RobustnessJob,
    load_robustness_config,
    run_robustness,
)
from relicv2.jobs.progress import Phase  # noqa: E402
from relicv2.jobs.ranks import Ranks  # noqa: E402
from relicv2.pretrain.config import load_config  # noqa: E402
from relicv2.pretrain.run import run_pretraining  # noqa: E402
from relicv2.saliency.network.build_masks import (  # noqa: E402
    build_masks,
    coverage_of,
    format_summary,
    mask_stats,
)
from relicv2.saliency.network.config import load_masks_config, load_saliency_config  # noqa: E402
from relicv2.saliency.network.mask_work import RawSample, finish  # noqa: E402
from relicv2.saliency.network.model_file import MODEL_NAME  # noqa: E402
from relicv2.saliency.network.train import TrainJob, run_train  # noqa: E402
from relicv2.saliency.preview import PreviewConfig, write_preview  # noqa: E402
from relicv2.saliency.selection import mean_sd  # noqa: E402
from relicv2.shards.build import BuildConfig, build_shards  # noqa: E402
from relicv2.shards.driver import TarUnits, UnitOutput, run_shard_job  # noqa: E402
from relicv2.shards.images import load_gray  # noqa: E402
from relicv2.shards.job import (  # noqa: E402
    ShardJob,
    check_plan,
    merge_records,
    tar_job,
)
from relicv2.shards.reader import ReadReport, read_samples  # noqa: E402
from relicv2.shards.sample import GENERATED_MEMBERS, MASK_FOREGROUND_LEVEL, MASK_MEMBER  # noqa: E402
from relicv2.shards.shardset import ShardSet, resolve_shard_set  # noqa: E402
from relicv2.shards.sources import reject  # noqa: E402
from relicv2.shards.writer import TarShard, shard_name  # noqa: E402

# The figures, declared before any run: the primary ones decide, the others are reported beside them.
PRIMARY = ("bg_gap", "in_c")
SECONDARY = ("knn", "linear")
FIGURES = {"bg_gap": "BG-gap", "in_c": "IN-C top-1", "knn": "kNN top-1", "linear": "linear top-1"}
PRESET = "imagenette-r18-cpu"  # the pretraining recipe of every arm (RESULTS "Pretraining on Imagenette, CPU")
ASPECT = (1 / 3, 3)  # the random rectangles' width / height, drawn log-uniformly within (clipped to fit)
BOOTSTRAP = 2000  # resamples of the val images
ROWS = "rows.jsonl"


# --- the random rectangle masks ------------------------------------------------------------------------

def random_rectangle(area: int, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A 0/1 uint8 [height, width] mask holding one rectangle of `area` pixels (within one of its rows),
    its aspect drawn log-uniformly within ASPECT (clipped so that it fits), placed uniformly at random."""
    mask = np.zeros((height, width), np.uint8)
    area = min(int(area), height * width)
    if area <= 0:
        return mask
    aspect = float(np.exp(rng.uniform(np.log(ASPECT[0]), np.log(ASPECT[1]))))
    w = int(np.clip(round((area * aspect) ** 0.5), -(-area // height), width))
    h = int(np.clip(round(area / w), 1, height))
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    mask[top : top + h, left : left + w] = 1
    return mask


def key_rng(seed: int, key: str) -> np.random.Generator:
    """The generator of one image's rectangle: the same whatever the order or the tar."""
    return np.random.default_rng([seed, int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)])


def rectangle_like(mask_png: bytes, seed: int, key: str) -> np.ndarray:
    """The random rectangle standing in for one saliency mask: a 0/1 float32 map of the mask's size."""
    saliency = load_gray(mask_png, key)
    area = int(np.count_nonzero(saliency >= MASK_FOREGROUND_LEVEL))
    return random_rectangle(area, *saliency.shape, key_rng(seed, key)).astype(np.float32)


@dataclass
class RectangleWork(TarUnits):
    """The random-mask set as a shard job (`shards.driver.UnitWork`): one unit an input tar of the saliency
    mask set, its samples written as build-masks writes them (`mask_work.finish`) with the mask replaced."""

    source: ShardSet
    seed: int
    plan: dict

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        for number in numbers:
            tar, report, rejected = self.source.tars[number], ReadReport(), []
            shard = TarShard(Path(self.plan["out"]) / shard_name("masked", number))
            for sample in read_samples(tar, report, index=self.source.index_files[number]):
                if MASK_MEMBER not in sample.members:
                    rejected.append(reject(f"{tar.name}:{sample.key}", "no_mask", "the saliency set has no mask"))
                    continue
                rectangle = rectangle_like(sample.members[MASK_MEMBER], self.seed, sample.key)
                carried = {ext: data for ext, data in sample.members.items()
                           if ext not in (MASK_MEMBER, sample.image_ext, *GENERATED_MEMBERS)}
                meta = {k: v for k, v in sample.meta.items() if not k.startswith("mask_")}
                raw = RawSample(sample.key, sample.members[sample.image_ext], sample.label, meta, sample.image_ext,
                                carried)
                shard.add_record(finish(raw, rectangle, rectangle.shape[1], rectangle.shape[0]))
                bar.update(1)
            rejected += report.rows()
            if not shard.rows:
                shard.abort()
                yield UnitOutput(None, rejected)
            else:
                shard.close()
                yield UnitOutput(shard, rejected)

    def merge(self, job: ShardJob, records: list[dict]) -> Any:
        return merge_records(job.out, records, info={"prefix": "masked", "source": str(self.source),
                                                     "mask": mask_stats(coverage_of(records)),
                                                     "random_rectangles": {"seed": self.seed, "aspect": ASPECT}})


def random_mask_set(saliency: Path, out: Path, seed: int) -> Path:
    """Write (or resume) the random-rectangle copy of the saliency mask set `saliency` in `out`."""
    source = resolve_shard_set(saliency)
    plan = {"source": [t.name for t in source.tars], "seed": seed, "aspect": list(ASPECT), "out": str(out)}
    job = tar_job(out, ".random-masks", source.tars, "masked", {"seed": seed, "aspect": list(ASPECT)})
    check_plan(job, plan, other="random masks of another set or seed")
    run_shard_job(job, RectangleWork(source, seed, plan), Ranks(), name="random masks")
    return out


# --- the statistics ------------------------------------------------------------------------------------

def paired_differences(arm: dict[int, float], control: dict[int, float]) -> dict[int, float]:
    """Per seed present in both, the arm's figure less the control's."""
    return {seed: arm[seed] - control[seed] for seed in sorted(arm.keys() & control.keys())}


def bootstrap_interval(per_image: np.ndarray, *, reps: int = BOOTSTRAP, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of the mean of `per_image` [N] over `reps` resamples of the images."""
    values = np.asarray(per_image, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(reps)
    for start in range(0, reps, 200):  # 200 resamples at a time: memory stays 200 x N
        picks = rng.integers(0, len(values), (min(200, reps - start), len(values)))
        means[start : start + len(picks)] = values[picks].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def per_image_difference(arm: dict[int, np.ndarray], control: dict[int, np.ndarray]) -> np.ndarray | None:
    """Per image, the arm's score less the control's, averaged over the seeds both have (paired by seed
    and by image); None when they share no seed or their images differ in number."""
    seeds = sorted(arm.keys() & control.keys())
    if not seeds or len({len(v) for s in seeds for v in (arm[s], control[s])}) != 1:
        return None
    return np.mean([arm[s] - control[s] for s in seeds], axis=0)


# --- the rows ------------------------------------------------------------------------------------------

def read_rows(path: Path) -> dict[tuple[str, int], dict]:
    """The rows recorded so far, by (arm, seed); a line cut short by a kill is left out."""
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[(row["arm"], row["seed"])] = row
    return rows


def record_row(path: Path, row: dict) -> None:
    """Append `row` as one line (after a line a kill cut short: on a line of its own)."""
    cut = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as handle:
        handle.write(("\n" if cut else "") + json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def grid_rows(out: Path, arms: list[str], seeds: list[int], measure: Callable[[str, int], dict]) -> dict:
    """Every (arm, seed) row: read from OUT/rows.jsonl when recorded, else measured and recorded at once.
    A seed's arms all run before the next seed's, so a grid stopped early still holds whole paired seeds."""
    rows = read_rows(out / ROWS)
    for seed in seeds:
        for arm in arms:
            if (arm, seed) not in rows:
                rows[(arm, seed)] = {"arm": arm, "seed": seed, **measure(arm, seed)}
                record_row(out / ROWS, rows[(arm, seed)])
    return rows


# --- the arms ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    name: str
    mask_probability: float
    masks: str  # "none", "saliency" or "random"


def parse_arm(name: str) -> Arm:
    if name == "control":
        return Arm(name, 0.0, "none")
    for prefix, masks in (("pm", "saliency"), ("random", "random")):
        if name.startswith(prefix):
            try:
                probability = float(name[len(prefix):])
            except ValueError:
                break
            if 0 < probability <= 1:
                return Arm(name, probability, masks)
    raise ValueError(f"arm {name!r}: give control, pmP (saliency masks at p_m P) or randomP (random rectangles)")


# --- the stages ----------------------------------------------------------------------------------------

def timed(times: dict, name: str, work: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = work()
    times[name] = round(time.perf_counter() - start, 1)
    return result


def shard_set(folder: Path, out: Path) -> Path:
    if not (out / "info.json").is_file():
        build_shards(BuildConfig(input=folder, out_dir=out, workers=2))
    return out


def val_subset(val: Path, out: Path, count: int) -> Path:
    """A folder of links to `count` val images, the same share of every class (seed 0), as class folders."""
    classes = sorted(p for p in val.iterdir() if p.is_dir())
    files = {c: sorted(f for f in c.iterdir() if f.is_file()) for c in classes}
    total = sum(len(f) for f in files.values())
    rng = np.random.default_rng(0)
    for c in classes:
        (out / c.name).mkdir(parents=True, exist_ok=True)
        take = round(count * len(files[c]) / total)
        for index in sorted(rng.permutation(len(files[c]))[:take]):
            link = out / c.name / files[c][index].name
            if not link.exists():
                os.symlink(files[c][index].resolve(), link)
    return out


@dataclass
class Grid:
    """The benchmark's folders and settings."""

    out: Path
    data: Path
    size: int
    epochs: int
    val_images: int
    saliency_set: list[str]
    pretrain_set: list[str]
    workers: int
    device: str  # of every job: "auto" takes a GPU when one is visible

    def prepare(self) -> dict:
        """Stages 1-2: the shard sets, the saliency network, its masks (with their histogram and previews)."""
        times: dict[str, float] = {}
        out = self.out
        timed(times, "shards", lambda: [shard_set(self.data / s, out / "shards" / s) for s in ("train", "val")])
        subset = val_subset(self.data / "val", out / "val-subset-images", self.val_images)
        timed(times, "val subset shards", lambda: shard_set(subset, out / "shards" / "val-subset"))
        config = load_saliency_config("cpu", [f"input_size={self.size}", f"device={self.device}", *self.saliency_set])
        timed(times, "saliency train", lambda: run_train(TrainJob(
            shards=out / "shards" / "train", out=out / "saliency", config=config, backbone="random"),
            log=lambda line: print(line, file=sys.stderr)))
        summaries = {}
        for name, shards in (("train", out / "shards" / "train"), ("val", out / "shards" / "val-subset")):
            masks = out / "masks" / name
            masks_config = load_masks_config("cpu", model=out / "saliency" / MODEL_NAME, shards=shards, out=masks,
                                             workers=self.workers, device=self.device)
            summary = timed(times, f"build-masks {name}", lambda c=masks_config: build_masks(c))
            print(format_summary(summary), file=sys.stderr)
            summaries[name] = {k: summary[k] for k in ("written", "rejected", "coverage_histogram",
                                                       "below_min_coverage", "mean_coverage")}
            write_preview(PreviewConfig(input=masks, output=out / f"masks-{name}.png", methods=(), count=12))
        (out / "masks-coverage.json").write_text(json.dumps(summaries, indent=2) + "\n")
        return times

    def train_masks(self, arm: Arm, seed: int) -> Path:
        if arm.masks == "none":
            return self.out / "shards" / "train"
        if arm.masks == "saliency":
            return self.out / "masks" / "train"
        masks = random_mask_set(self.out / "masks" / "train", self.out / f"random-masks-s{seed}", seed)
        if not (preview := self.out / f"masks-random-s{seed}.png").is_file():
            write_preview(PreviewConfig(input=masks, output=preview, methods=(), count=12))
        return masks

    def run_folder(self, arm: str, seed: int) -> Path:
        return self.out / "runs" / f"{arm}-s{seed}"

    def measure(self, name: str, seed: int) -> dict:
        """Pretrain one arm at one seed and score its encoder: the row's figures, per-image files and times."""
        arm, times, out = parse_arm(name), {}, self.out
        run = self.run_folder(name, seed)
        shards = timed(times, "masks", lambda: self.train_masks(arm, seed))
        config = load_config(PRESET, [f"data.train_shards={shards}", f"views.mask_probability={arm.mask_probability}",
                                      f"run.seed={seed}", f"run.output_dir={run}", f"optim.epochs={self.epochs}",
                                      f"run.device={self.device}",
                                      "knn.train_shards=", "knn.val_shards=", "run.progress_bar=false",
                                      *self.pretrain_set])
        pretrained = timed(times, "pretrain", lambda: run_pretraining(config))
        backbone = Backbone(checkpoint=run)
        scores = out / "scores" / f"{name}-s{seed}"
        train, val = out / "shards" / "train", out / "shards" / "val"
        # The whole image at the views' size, as RESULTS' Imagenette evaluations and the guide take it; the head
        # carries this view to the robustness and backgrounds sets.
        view = {"crop_size": self.size, "resize_size": self.size}
        given = frozenset(view)
        timed(times, "knn", lambda: run_eval(EvalJob(backbone, train, val, knn_settings(view), given=given,
                                                     json_path=scores / "knn.json", device=self.device)))
        linear = load_linear_config("fast", [f"{k}={v}" for k, v in view.items()])
        timed(times, "linear", lambda: run_eval(EvalJob(backbone, train, val, linear, output=scores / "linear",
                                                        json_path=scores / "linear.json", device=self.device, given=given)))
        head = scores / "linear" / TRAINED_HEAD_FILE
        control_head = out / "scores" / f"control-s{seed}" / "linear" / TRAINED_HEAD_FILE
        with_control = name != "control" and control_head.is_file()
        robust = timed(times, "robustness", lambda: run_robustness(RobustnessJob(
            backbone, head, out / "robustness", load_robustness_config("quick", [f"workers={self.workers}"]),
            val=out / "shards" / "val-subset", json_path=scores / "robustness.json", device=self.device,
            control=Backbone(checkpoint=self.run_folder("control", seed)) if with_control else None,
            control_head=control_head if with_control else None)))
        timed(times, "backgrounds", lambda: run_backgrounds(
            backbone, head, out / "masks" / "val", None, out / "backgrounds", load_backgrounds_config("default"),
            json_path=scores / "backgrounds.json", device=self.device))
        backgrounds = json.loads((scores / "backgrounds.json").read_text())
        per_image = {"in_c": in_c_per_image(out / "robustness"),
                     "bg_gap": bg_gap_per_image(out / "backgrounds")}
        np.savez(scores / "per-image.npz", **per_image)
        return {"p_m": arm.mask_probability, "masks": arm.masks, "steps": pretrained.step,
                "bg_gap": backgrounds["bg_gap"], "in_c": robust["corrupted"]["mean_top1"],
                "mce_vs_control": robust["corrupted"]["mce"],
                "knn": json.loads((scores / "knn.json").read_text())["top1"],
                "linear": json.loads((scores / "linear.json").read_text())["top1"],
                "backgrounds": backgrounds["accuracy"], "per_image": str(scores / "per-image.npz"), "seconds": times}


def in_c_per_image(robustness: Path) -> np.ndarray:
    """Per val image, its share of correct answers over the corrupted sets (`robustness.PER_IMAGE_FILE` of
    the encoder just scored there): its part of the mean IN-C top-1, as every set holds the same images in
    the same order."""
    sets = json.loads((robustness / PER_IMAGE_FILE).read_text())["corrupted"]
    return np.mean([np.frombuffer(c.encode(), np.uint8) - ord("0") for c in sets.values()], axis=0)


def bg_gap_per_image(backgrounds: Path) -> np.ndarray:
    """Per val image, mixed_same correct less mixed_rand correct (the composites of one image share its
    foreground; both variants are written in the screened images' order)."""
    correct = {}
    for name in ("mixed_same", "mixed_rand"):
        scored = json.loads((backgrounds / "scores" / f"{name}.json").read_text())
        correct[name] = (np.array(scored["predictions"]) == np.array(scored["labels"])).astype(np.float64)
    return correct["mixed_same"] - correct["mixed_rand"]


# --- the table -----------------------------------------------------------------------------------------

def table(rows: dict[tuple[str, int], dict], arms: list[str], *, reps: int = BOOTSTRAP) -> str:
    """The markdown tables RESULTS.md holds."""
    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        mean, sd = mean_sd(values)  # no sd for one seed: nothing to show
        return f"{mean:.4f}" + ("" if sd is None else f" ± {sd:.4f}")

    by_arm = {arm: {seed: row for (a, seed), row in rows.items() if a == arm} for arm in arms}
    lines = ["| arm | p_m | masks | seeds | " + " | ".join(FIGURES[f] for f in (*PRIMARY, *SECONDARY)) + " |",
             "|---|---|---|---|" + "---|" * (len(PRIMARY) + len(SECONDARY))]
    for arm in arms:
        seeded = by_arm[arm]
        if not seeded:
            continue
        first = next(iter(seeded.values()))
        lines.append(f"| {arm} | {first['p_m']} | {first['masks']} | {','.join(map(str, sorted(seeded)))} | "
                     + " | ".join(cell([r[f] for r in seeded.values()]) for f in (*PRIMARY, *SECONDARY)) + " |")
    control = by_arm.get("control", {})
    if control:
        lines += ["", "Paired difference from the control (same seeds): mean ± sd over seeds (each seed's); for the "
                      f"primary figures, CI: the 95% bootstrap interval over val images ({reps} resamples)", "",
                  "| arm | " + " | ".join(f"Δ {FIGURES[f]}" for f in (*PRIMARY, *SECONDARY)) + " |",
                  "|---|" + "---|" * (len(PRIMARY) + len(SECONDARY))]
        images = {arm: {s: np.load(r["per_image"]) for s, r in by_arm[arm].items()} for arm in arms}
        for arm in arms:
            if arm == "control" or not by_arm[arm]:
                continue
            cells = []
            for figure in (*PRIMARY, *SECONDARY):
                diffs = paired_differences({s: r[figure] for s, r in by_arm[arm].items()},
                                           {s: r[figure] for s, r in control.items()})
                if not diffs:
                    cells.append("-")
                    continue
                text = f"{cell(list(diffs.values()))} (seeds {' / '.join(f'{d:+.4f}' for d in diffs.values())})"
                if figure in PRIMARY:
                    delta = per_image_difference({s: v[figure] for s, v in images[arm].items()},
                                                 {s: v[figure] for s, v in images["control"].items()})
                    if delta is not None:
                        low, high = bootstrap_interval(delta, reps=reps)
                        text += f"; CI [{low:+.4f}, {high:+.4f}]"
                cells.append(text)
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="work folder (rerun the same command to resume)")
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data"
                        / "imagenette-112", help="a folder of train/ and val/ class folders (default: Imagenette-112)")
    parser.add_argument("--seeds", default="0,1,2", help="pretraining seeds, the same in every arm (paired)")
    parser.add_argument("--arms", default="control,pm0.1,pm0.3,random0.1")
    parser.add_argument("--size", type=int, default=64, help="views and saliency network input, px")
    parser.add_argument("--epochs", type=int, default=1, help="pretraining epochs of every arm")
    parser.add_argument("--val-images", type=int, default=1000, help="the val subset of robustness and backgrounds")
    parser.add_argument("--saliency-set", action="append", default=[], metavar="KEY=VALUE",
                        help="saliency train overrides (e.g. threads=2 on a quiet box; num_images=...)")
    parser.add_argument("--pretrain-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="pretraining overrides for every arm")
    parser.add_argument("--workers", type=int, default=2, help="processes of build-masks and the corruptions")
    parser.add_argument("--device", default="auto", help="of every job: auto (a GPU when one is visible), cpu, cuda")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help="resamples of the val images")
    args = parser.parse_args(argv)
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    for arm in arms:
        try:
            parse_arm(arm)
        except ValueError as error:
            parser.error(str(error))
    if not all((args.data / split).is_dir() for split in ("train", "val")):
        parser.error(f"--data {args.data} has no train/ and val/ class folders (Imagenette-112's layout)")
    size = [f"views.large_size={args.size}", f"views.small_size={args.size // 2}"]
    grid = Grid(args.out, args.data, args.size, args.epochs, args.val_images, args.saliency_set,
                [*size, *args.pretrain_set], args.workers, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    prepare_times = grid.prepare()
    print(f"prepared in {time.perf_counter() - start:.0f} s: {prepare_times}", file=sys.stderr)
    if not (args.out / "prepare-seconds.json").is_file():  # the first run's: the one that did the work
        (args.out / "prepare-seconds.json").write_text(json.dumps(prepare_times) + "\n")
    # The control first at every seed: it is the other arms' CE baseline.
    ordered = ["control", *(a for a in arms if a != "control")] if "control" in arms else arms
    rows = grid_rows(args.out, ordered, seeds, grid.measure)
    print(f"grid in {time.perf_counter() - start:.0f} s (this run); seconds per stage of each row in {ROWS}")
    print(table({key: row for key, row in rows.items() if key[0] in arms and key[1] in seeds}, ordered,
                reps=args.bootstrap))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Choose a saliency pipeline on labelled dev images and estimate, cross-validated, what the choice scores.

The dev images (PASCAL-S dev: 300 images with masks) never reach a training set: the command refuses a
--train-images folder holding a file with a dev image's bytes. They only choose and score.

Steps, each resumable in --out (rerun the same command; a subset of recipes or seeds is a smaller grid):
1. `shards build` of the training folders into OUT/train-shards (a recipe with `extra_images=DIR` values: of the
   folders and those, into OUT/sets/ID), the dev images' handcrafted maps and their mean into OUT/heldout (as
   `saliency_quality.py`);
2. for each recipe (a `saliency train` preset and `--set` values) and seed: `saliency train` into
   OUT/train/RECIPE/seed-SEED (the seed is the config's `seed`: the sampled images and the networks' starts),
   the training images' handcrafted maps computed once for every run on the same shards, in their train-maps;
3. every candidate scored on every dev image once, recorded as it comes: a line of OUT/rows.jsonl (its scores
   on all dev images) and its per-image scores in OUT/scores/; the candidates: each handcrafted method, the mean
   of their maps, and each recipe's network at each test-time option of `saliency_quality.py` (plain, flip, CRF,
   flip + CRF, averaged with the mean of the maps, flip + maps);
4. the estimate, printed:
   - folds: the dev images' names sorted, shuffled by random.Random(--fold-seed) and dealt round robin into
     --folds folds (default 5 folds, fold seed 0: 60 images a fold on PASCAL-S dev);
   - per candidate, its scores on all dev images: mean and standard deviation over the seeds, and its paired
     difference from the mean of the maps and from the best candidate (the same seed's networks, the same
     images): the mean, the standard deviation of the per-seed differences, and the fold standard error (the
     standard deviation of the per-fold differences / sqrt(folds));
   - nested selection, per seed: for each fold, the candidate with the highest max-F on the other folds (every
     candidate of that seed), scored on that fold; the folds' scores add up to the selected pipeline's held-out
     score, given with its mean and spread over the seeds.
   A paired difference separates two candidates above 2 sqrt(seed sd^2 / seeds + fold se^2): the networks'
   training noise and the draw of the images (one seed measures the second alone).
Max-F is the maximum of the mean F curve of the images scored (`saliency.metrics.ScoreSums`), on every subset.
5. with --coverage-shards SET (a shard set of the images the masks are for, e.g. Imagenette's val set built by
   `shards build`): `saliency build-masks` of SET by each recipe's network of the first seed, at each of its
   options (plain, flip, CRF, flip + CRF), into OUT/coverage/RECIPE/OPTION; printed, each candidate's mask
   coverage (the fraction of the image at or above the foreground level, as pretraining reads it): its mean,
   the masks below pretraining's minimum, and the histogram in tenths. A score that rises as the masks shrink
   is a score the pretraining may not share.

    python benchmarks/saliency_selection.py --out OUT --train-images $DATA/msra-unlabeled \\
        [--train-images $DATA/imagenette-112/train] --dev-images $DATA/pascal-s-dev/images \\
        --dev-masks $DATA/pascal-s-dev/masks [--recipe "NAME=PRESET [KEY=VALUE ...]" ...] [--seeds 0 1 2] \\
        [--folds 5] [--fold-seed 0] [--backbone FILE|random] [--set KEY=VALUE ...] [--coverage-shards SET]

--recipe defaults to "cpu=cpu" (the `cpu` preset); --set values apply to every recipe. A recipe's `extra_images=DIR`
(repeatable) adds DIR to the training folders of that recipe alone: the lever "more images" in one grid.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the steps shared with saliency_quality.py

import saliency_quality as quality  # noqa: E402

from relicv2.jobs.atomic import atomic_write_bytes  # noqa: E402
from relicv2.jobs.lock import FolderLockedError, folder_lock  # noqa: E402
from relicv2.jobs.progress import Phase  # noqa: E402
from relicv2.jobs.ranks import Ranks  # noqa: E402
from relicv2.pretrain.checkpoint import CheckpointError  # noqa: E402
from relicv2.saliency.evaluate import score_folder_images, score_model_images  # noqa: E402
from relicv2.saliency.metrics import ImageScores, ScoreSums, summed  # noqa: E402
from relicv2.saliency.network.build_masks import build_masks  # noqa: E402
from relicv2.saliency.network.config import (  # noqa: E402
    SaliencyTrainConfig,
    load_masks_config,
    load_saliency_config,
)
from relicv2.saliency.network.model_file import MODEL_NAME  # noqa: E402
from relicv2.saliency.network.report import FUSED_ROW, MEAN_ROW  # noqa: E402
from relicv2.saliency.network.train import TrainJob, TrainStateError, run_train  # noqa: E402
from relicv2.saliency.selection import (  # noqa: E402
    assign_folds,
    check_kept_out,
    fold_sums,
    mean_sd,
    paired_difference,
    select,
    total,
)

ROWS = "rows.jsonl"
RECIPE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Recipe:
    """A saliency network recipe: a name, a `saliency train` preset (or YAML file), `--set` values and the backbone."""

    name: str
    preset: str
    overrides: tuple[str, ...]
    backbone: str = "random"
    extra_images: tuple[Path, ...] = ()  # training folders of this recipe alone

    def folders(self, common: list[Path]) -> list[Path]:
        return [*common, *self.extra_images]

    def shard_set(self, out: Path) -> Path:
        """Where this recipe's training shards (and their maps) are built: OUT itself for the common folders."""
        if not self.extra_images:
            return out
        return out / "sets" / hashlib.sha256("\n".join(str(p.resolve()) for p in self.extra_images).encode()).hexdigest()[:10]

    @property
    def spec(self) -> str:
        """What the recipe's rows were scored with, in words (a row of another spec is refused)."""
        extra = [f"extra_images={p}" for p in self.extra_images]
        backbone = [] if self.backbone == "random" else ["from", self.backbone]
        return " ".join([self.preset, *self.overrides, *extra, *backbone])

    def config(self, seed: int) -> SaliencyTrainConfig:
        return load_saliency_config(self.preset, [*self.overrides, f"seed={seed}"])


def parse_recipe(text: str, common: list[str], backbone: str = "random") -> Recipe:
    name, sep, spec = text.partition("=")
    if not sep or not RECIPE_NAME.fullmatch(name) or not spec.split():
        raise ValueError(f"--recipe {text!r}: give NAME=PRESET [KEY=VALUE ...] (NAME of letters, digits, '_.-'), "
                         "e.g. --recipe \"r64=cpu input_size=64\"")
    preset, *tokens = spec.split()
    extra = tuple(Path(t.split("=", 1)[1]) for t in tokens if t.startswith("extra_images="))
    overrides = tuple(t for t in tokens if not t.startswith("extra_images="))
    return Recipe(name, preset, (*common, *overrides), backbone, extra)


class Rows:
    """OUT/rows.jsonl (a line a scored candidate and seed) and the per-image scores it points to."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / ROWS
        self.rows: dict[tuple[str, int | None], dict] = {}
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a line cut short by a kill: dropped, and that candidate scored again
                    atomic_write_bytes(self.path, "".join(f"{kept}\n" for kept in lines[:-1]).encode())
                    continue
                raise ValueError(f"{self.path}: line {number} is not JSON; delete that line to score it again") from None
            if (out / row["file"]).is_file():
                self.rows[(row["candidate"], row["seed"])] = row

    def has(self, candidate: str, seed: int | None, spec: str | None) -> bool:
        row = self.rows.get((candidate, seed))
        if row is not None and row["spec"] != spec:
            raise ValueError(f"{self.path}: {candidate} (seed {seed}) was scored with the recipe {row['spec']!r}, "
                             f"not {spec!r}; give that recipe another name, or choose another --out")
        return row is not None

    def add(self, candidate: str, seed: int | None, spec: str | None, scores: dict[str, ImageScores]) -> dict:
        file = f"scores/{slug(candidate)}.npz" if seed is None else f"scores/seed-{seed}/{slug(candidate)}.npz"
        stems = sorted(scores)
        buffer = io.BytesIO()
        np.savez(buffer, stems=np.array(stems), mae=[scores[s].mae for s in stems],
                 f_curve=np.array([scores[s].f_curve for s in stems]),
                 adaptive_f=[scores[s].adaptive_f for s in stems], s_measure=[scores[s].s_measure for s in stems])
        (self.out / file).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.out / file, buffer.getvalue())
        whole = summed(scores.values()).scores()
        row = {"candidate": candidate, "seed": seed, "spec": spec, "images": whole.count, "mae": whole.mae,
               "max_f": whole.max_f, "adaptive_f": whole.adaptive_f, "file": file}
        with self.path.open("a") as stream:
            stream.write(json.dumps(row) + "\n")
        self.rows[(candidate, seed)] = row
        return row

    def per_image(self, candidate: str, seed: int | None) -> dict[str, ImageScores]:
        with np.load(self.out / self.rows[(candidate, seed)]["file"]) as data:
            return {str(stem): ImageScores(float(data["mae"][i]), data["f_curve"][i], float(data["adaptive_f"][i]),
                                           float(data["s_measure"][i])) for i, stem in enumerate(data["stems"])}


def slug(name: str) -> str:
    """A file or folder name for a candidate or an option."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def marked(candidate: str) -> str:
    """The candidate's name, marked when it is a network row that `build-masks` writes by default."""
    default = candidate.endswith(f": {FUSED_ROW}{quality.default_options()}")
    return candidate + (quality.DEFAULT_MARK if default else "")


def network_candidates(recipe: Recipe) -> list[str]:
    return [f"{recipe.name}: {FUSED_ROW}{suffix}" for suffix in quality.NETWORK_OPTIONS]


def run(args: argparse.Namespace) -> int:
    recipes = [parse_recipe(text, args.overrides, args.backbone) for text in (args.recipe or ["cpu=cpu"])]
    args.seeds = list(dict.fromkeys(args.seeds))  # a seed given twice is one run
    if len({r.name for r in recipes}) < len(recipes):
        raise ValueError("two --recipe share a name; name each recipe once")
    configs = {(r.name, seed): r.config(seed) for r in recipes for seed in args.seeds}  # bad keys fail now
    for option in ("dev_images", "dev_masks"):
        if not getattr(args, option).is_dir():
            raise FileNotFoundError(f"--{option.replace('_', '-')} {getattr(args, option)} is not a folder")
    check_kept_out(args.train_images, args.dev_images)
    for recipe in recipes:
        for folder in recipe.extra_images:
            if not folder.is_dir():
                raise FileNotFoundError(f"--recipe {recipe.name}: extra_images={folder} is not a folder")
        check_kept_out(recipe.extra_images, args.dev_images, f"--recipe {recipe.name} extra_images")
    args.out.mkdir(parents=True, exist_ok=True)
    with folder_lock(args.out, "saliency_selection.py"):
        first = configs[(recipes[0].name, args.seeds[0])]
        maps, mean = quality.heldout_maps(args.dev_images, args.out, first, args.progress)
        rows = Rows(args.out)
        for name, folder in [*[(m, maps / m) for m in first.methods], (MEAN_ROW, mean)]:
            if not rows.has(name, None, None):
                score(rows, name, None, None, lambda f=folder: score_folder_images(f, args.dev_masks, True))
        runs = Phase("selection: recipes x seeds", len(configs), unit="run", enabled=args.progress)
        for recipe in recipes:
            for seed in args.seeds:
                names = network_candidates(recipe)
                if not all(rows.has(name, seed, recipe.spec) for name in names):
                    train, home = args.out / "train" / recipe.name / f"seed-{seed}", recipe.shard_set(args.out)
                    shards = quality.training_shards(recipe.folders(args.train_images), home, first.workers,
                                                     args.progress)
                    shared_maps(train, home / "train-maps")
                    run_train(TrainJob(shards=shards, out=train, config=configs[(recipe.name, seed)],
                                       backbone=recipe.backbone, progress=args.progress),
                              log=lambda line: print(line, file=sys.stderr))
                    for name, suffix in zip(names, quality.NETWORK_OPTIONS, strict=True):
                        if not rows.has(name, seed, recipe.spec):
                            job = quality.network_evaluation(train / MODEL_NAME, args.dev_images, args.dev_masks,
                                                             maps, suffix)
                            score(rows, name, seed, recipe.spec, lambda job=job: score_model_images(job))
                runs.update()
        runs.close()
        candidates = [*first.methods, MEAN_ROW, *[n for r in recipes for n in network_candidates(r)]]
        print(f"recipes: {'; '.join(f'{r.name} = {r.spec}' for r in recipes)}; backbone {args.backbone}; "
              f"training images {', '.join(map(str, args.train_images))}")
        print(summarise(rows, candidates, args.seeds, args.folds, args.fold_seed))
        if args.coverage_shards is not None:
            print(coverage_table({name: stats for recipe in recipes
                                  for name, stats in coverage(recipe, args.seeds[0], args).items()}, args.seeds[0]))
    return 0


# The network rows `saliency build-masks` can write: NETWORK_OPTIONS' suffixes whose options are its own.
MASK_OPTIONS = {suffix: options for suffix, options in quality.NETWORK_OPTIONS.items() if "maps" not in options}


def coverage(recipe: Recipe, seed: int, args: argparse.Namespace) -> dict[str, dict]:
    """Candidate name -> build-masks' summary of --coverage-shards masked by `recipe`'s network of `seed` at
    each of MASK_OPTIONS (each job resumable in OUT/coverage)."""
    model = args.out / "train" / recipe.name / f"seed-{seed}" / MODEL_NAME
    found = {}
    for suffix, options in MASK_OPTIONS.items():
        config = load_masks_config(None, [], model=model, shards=args.coverage_shards,
                                   out=args.out / "coverage" / recipe.name / slug(f"plain{suffix}"),
                                   progress=args.progress, **options)
        found[f"{recipe.name}: {FUSED_ROW}{suffix}"] = build_masks(config, Ranks())
    return found


def coverage_table(summaries: dict[str, dict], seed: int) -> str:
    """build-masks' coverage figures of each candidate, as Markdown."""
    lines = [f"\nMask coverage on --coverage-shards (seed {seed}'s networks; histogram: masks per tenth of coverage)",
             "\n| candidate | masks | mean coverage | below the minimum | histogram 0-0.1, ..., 0.9-1 |",
             "|---|---|---|---|---|"]
    for name, summary in summaries.items():
        lines.append(f"| {marked(name)} | {summary['written']} | {summary['mean_coverage']:.3f} | "
                     f"{summary['below_min_coverage']} (< {summary['min_coverage']}) | "
                     f"{' '.join(map(str, summary['coverage_histogram']))} |")
    return "\n".join(lines)


def shared_maps(train: Path, maps: Path) -> None:
    """Point the training run's map cache (`saliency train`'s OUT/maps) at `maps`, one for every run on the same
    shards: a map is a function of the image alone, and the shards' keys name the same images in every run."""
    link = train / "maps"
    if not link.is_symlink() and not link.exists():
        maps.mkdir(parents=True, exist_ok=True)
        train.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(maps, train), target_is_directory=True)  # relative: OUT may move


def score(rows: Rows, candidate: str, seed: int | None, spec: str | None,
          scores: Callable[[], dict[str, ImageScores]]) -> None:
    start = time.perf_counter()
    row = rows.add(candidate, seed, spec, scores())
    print(f"selection: {candidate}" + ("" if seed is None else f", seed {seed}") + f": max-F {row['max_f']:.3f}, "
          f"MAE {row['mae']:.3f} on {row['images']} images ({time.perf_counter() - start:.0f} s)", file=sys.stderr)


def _spread(mean: float, sd: float | None) -> str:
    return f"{mean:.3f}" + ("" if sd is None else f" ± {sd:.3f}")


def summarise(rows: Rows, candidates: list[str], seeds: list[int], k: int, fold_seed: int) -> str:
    """The estimate (the module's docstring, step 4) as Markdown tables."""
    folds = assign_folds(rows.per_image(MEAN_ROW, None), k, fold_seed)
    sums: dict[str, list[list[ScoreSums]]] = {}  # candidate -> per seed, the sums of each fold
    fixed = {name for name in candidates if (name, None) in rows.rows}  # handcrafted: the same for every seed
    for name in candidates:
        sums[name] = [fold_sums(rows.per_image(name, None if name in fixed else seed), folds, f"{rows.path}: {name}")
                      for seed in seeds]
    whole = {name: [total(by_fold).scores() for by_fold in per_seed] for name, per_seed in sums.items()}
    best = max(candidates, key=lambda n: mean_sd([s.max_f for s in whole[n]])[0])
    images = sum(len(f) for f in folds)
    lines = [f"\n{images} dev images, {k} folds (fold seed {fold_seed}), seeds {', '.join(map(str, seeds))}; "
             "a ± is the standard deviation over the seeds; a difference is paired (same seed, same images): "
             "mean ± its seed sd [fold se]; it separates two candidates above 2 sqrt(seed sd^2 / seeds + fold se^2)",
             f"\n| candidate | max-F | MAE | adaptive-F | max-F - {MEAN_ROW} | MAE - {MEAN_ROW} | max-F - best ({best}) |",
             "|---|---|---|---|---|---|---|"]
    for name in candidates:
        runs = whole[name][:1] if name in fixed else whole[name]
        cells = [_spread(*mean_sd([getattr(s, m) for s in runs])) for m in ("max_f", "mae", "adaptive_f")]
        for other, metric in ((MEAN_ROW, "max_f"), (MEAN_ROW, "mae"), (best, "max_f")):
            d = paired_difference(sums[name], sums[other], metric)
            cells.append(f"{d.mean:+.3f}" + ("" if d.seed_sd is None else f" ± {d.seed_sd:.3f}") + f" [{d.fold_se:.3f}]")
        lines.append(f"| {marked(name)} | {' | '.join(cells)} |")
    lines += [f"\nNested selection: each fold scored by the candidate chosen on the other {k - 1} (highest max-F)",
              "\n| seed | chosen, fold by fold | held out: max-F | MAE |", "|---|---|---|---|"]
    held = []
    for i, seed in enumerate(seeds):
        chosen = select({name: sums[name][i] for name in candidates})
        held.append(chosen.held_out.scores())
        lines.append(f"| {seed} | {'; '.join(chosen.chosen)} | {held[-1].max_f:.3f} | {held[-1].mae:.3f} |")
    lines.append(f"| all | selected pipeline | {_spread(*mean_sd([h.max_f for h in held]))} | "
                 f"{_spread(*mean_sd([h.mae for h in held]))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="work folder (rerun the same command to resume)")
    parser.add_argument("--train-images", type=Path, action="append", required=True,
                        help="folder of unlabelled training images (repeatable: the folders are joined)")
    parser.add_argument("--dev-images", type=Path, required=True, help="labelled dev images: choose and score only")
    parser.add_argument("--dev-masks", type=Path, required=True)
    parser.add_argument("--recipe", action="append", metavar="NAME=PRESET [KEY=VALUE ...]",
                        help="a network recipe, trained once a seed (repeatable; default: cpu=cpu)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--fold-seed", type=int, default=0)
    parser.add_argument("--backbone", default="random", help="encoder weights (default: random)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every recipe")
    parser.add_argument("--coverage-shards", type=Path, metavar="SET",
                        help="a shard set to mask with each recipe's network of the first seed: mask coverage")
    parser.add_argument("--progress", action="store_true", help="progress bars on stderr")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, FolderLockedError, TrainStateError, CheckpointError) as error:  # MasksError too
        print(f"saliency_selection: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

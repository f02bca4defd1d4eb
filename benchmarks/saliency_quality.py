"""Saliency quality end to end: train the saliency network on some images, score it on held-out labelled ones.

Steps, each through the library as the `relicv2` commands run them (and each resumable in --out):
1. `shards build` of the training images (every --train-images folder, flat) into OUT/train-shards;
2. `saliency train` (settings: --config and --set, as that command takes them) into OUT/train;
   (with --train-masks, its report also scores the refined labels and the network on the training images);
3. `saliency handcrafted` on the held-out images into OUT/heldout/maps, and their per-pixel mean;
4. `saliency evaluate` of each handcrafted method, the mean of the four, and the fused network
   (plain, with flip averaging, refined by its dense CRF, and averaged with the mean of the maps) against
   --heldout-masks.
Prints the table (MAE / max-F / adaptive-F, beta^2 = 0.3; the network's row that `saliency build-masks` writes
with its default settings marked "(default)") and the wall time of each step. A training folder holding
a held-out image (the same bytes, under any name) is refused. To choose among recipes and test-time options on
labelled dev images without scoring the choice on the images it was made on: `saliency_selection.py`.

    python benchmarks/saliency_quality.py --out OUT --train-images DIR [--train-images DIR2] \\
        --heldout-images DIR --heldout-masks DIR [--backbone FILE|random] [--config cpu] [--set k=v ...]

--backbone is a relicv2 pretrain run folder, checkpoint or ResNet state dict. Without one the encoder
starts from random weights; the project's CPU backbone is made by
`relicv2 pretrain --config imagenette-r18-cpu --output RUN` (Imagenette-112 shards; see RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.jobs.lock import FolderLockedError  # noqa: E402
from relicv2.pretrain.checkpoint import CheckpointError  # noqa: E402
from relicv2.saliency.batch import HandcraftedConfig, run_handcrafted  # noqa: E402
from relicv2.saliency.evaluate import ModelEvaluation, evaluate_folder, evaluate_model  # noqa: E402
from relicv2.saliency.images import list_images, write_map  # noqa: E402
from relicv2.saliency.metrics import DatasetScores  # noqa: E402
from relicv2.saliency.network.config import (  # noqa: E402
    BuildMasksConfig,
    SaliencyTrainConfig,
    load_saliency_config,
)
from relicv2.saliency.network.model_file import MODEL_NAME  # noqa: E402
from relicv2.saliency.network.predictor import mean_of_maps  # noqa: E402
from relicv2.saliency.network.report import FUSED_ROW, MEAN_ROW, format_report  # noqa: E402
from relicv2.saliency.network.train import TrainJob, TrainStateError, run_train  # noqa: E402
from relicv2.saliency.selection import check_kept_out  # noqa: E402
from relicv2.shards.build import BuildConfig, build_shards  # noqa: E402


def training_shards(folders: list[Path], out: Path, workers: int, progress: bool) -> Path:
    """OUT/train-shards built from the images of every folder (one folder of links to them: a flat layout)."""
    links = out / "train-images"
    links.mkdir(parents=True, exist_ok=True)
    for i, folder in enumerate(folders):
        link = links / f"{i}-{Path(folder).name}"
        if not link.exists():
            os.symlink(Path(folder).resolve(), link, target_is_directory=True)
    shards = out / "train-shards"
    if not (shards / "info.json").is_file():
        build_shards(BuildConfig(input=links, out_dir=shards, layout="flat", workers=workers, progress=progress))
    return shards


def heldout_maps(images: Path, out: Path, config: SaliencyTrainConfig, progress: bool) -> tuple[Path, Path]:
    """(the handcrafted maps of the held-out images, a folder of their per-pixel means)."""
    maps, mean = out / "heldout" / "maps", out / "heldout" / "mean"
    run_handcrafted(HandcraftedConfig(methods=config.methods, input=images, output=maps, workers=config.workers,
                                      progress=progress))
    for path in list_images(images):
        target = mean / f"{path.stem}.png"
        if not target.is_file() and all((maps / m / target.name).is_file() for m in config.methods):
            write_map(target, mean_of_maps(maps, config.methods, path.stem))
    return maps, mean


def score_rows(model: Path, images: Path, masks: Path, maps: Path, mean: Path,
               config: SaliencyTrainConfig) -> dict[str, DatasetScores]:
    """Each handcrafted method, their mean, and the fused network with and without its test-time options.

    The masks folder may hold more masks than there are held-out images (a data set's whole mask folder):
    the images that have a mask are scored, and the table says how many."""
    rows = {m: evaluate_folder(maps / m, masks, allow_missing=True) for m in config.methods}
    rows[MEAN_ROW] = evaluate_folder(mean, masks, allow_missing=True)
    for suffix in NETWORK_OPTIONS:
        rows[FUSED_ROW + suffix] = evaluate_model(network_evaluation(model, images, masks, maps, suffix))
    return rows


# The fused network's rows: the suffix of the row's name -> its test-time options (ModelEvaluation's fields;
# "maps": averaged with the mean of the held-out images' handcrafted maps).
NETWORK_OPTIONS = {"": {}, ", flip": {"flip": True}, " + CRF": {"crf": True}, ", flip + CRF": {"flip": True, "crf": True},
                   " + maps": {"maps": True}, ", flip + maps": {"flip": True, "maps": True}}


DEFAULT_MARK = " (default)"  # on the row whose masks `saliency build-masks` writes with its default settings


def default_options() -> str:
    """The NETWORK_OPTIONS suffix of the masks `saliency build-masks` writes by default (its --flip and --crf)."""
    defaults = {f.name: f.default for f in fields(BuildMasksConfig)}
    wanted = {option: True for option in ("flip", "crf") if defaults[option]}
    return next(suffix for suffix, options in NETWORK_OPTIONS.items() if options == wanted)


def network_evaluation(model: Path, images: Path, masks: Path, maps: Path, suffix: str) -> ModelEvaluation:
    """The evaluation of the network's row named FUSED_ROW + `suffix` (NETWORK_OPTIONS) on the held-out images."""
    options = dict(NETWORK_OPTIONS[suffix])
    if options.pop("maps", False):
        options["maps"] = maps
    return ModelEvaluation(model=model, images=images, gt=masks, allow_missing=True, **options)


def format_rows(rows: dict[str, DatasetScores]) -> str:
    lines = ["| row | MAE | max-F | adaptive-F | images |", "|---|---|---|---|---|"]
    marked = FUSED_ROW + default_options()
    lines += [f"| {name}{DEFAULT_MARK if name == marked else ''} | {s.mae:.3f} | {s.max_f:.3f} | {s.adaptive_f:.3f} | "
              f"{s.count} |" for name, s in rows.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="work folder (rerun the same command to resume)")
    parser.add_argument("--train-images", type=Path, action="append", required=True,
                        help="folder of training images (repeatable: the folders are joined)")
    parser.add_argument("--heldout-images", type=Path, required=True)
    parser.add_argument("--heldout-masks", type=Path, required=True)
    parser.add_argument("--train-masks", type=Path,
                        help="masks of (some of) the training images: also score the refined labels, the mean of "
                             "the maps and the fused network on them (the train side of the gap)")
    parser.add_argument("--backbone", default="random", help="encoder weights (default: random)")
    parser.add_argument("--config", default="cpu", help="saliency train preset or YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--progress", action="store_true", help="progress bars on stderr")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, FolderLockedError, TrainStateError, CheckpointError) as error:
        print(f"saliency_quality: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    config = load_saliency_config(args.config, args.overrides)
    for option in ("heldout_images", "heldout_masks"):
        if not getattr(args, option).is_dir():
            raise FileNotFoundError(f"--{option.replace('_', '-')} {getattr(args, option)} is not a folder")
    check_kept_out(args.train_images, args.heldout_images)  # a held-out image trained on would flatter the network
    times: dict[str, float] = {}
    start = time.perf_counter()
    shards = training_shards(args.train_images, args.out, config.workers, args.progress)
    times["training shards"] = time.perf_counter() - start
    mark = time.perf_counter()
    report = run_train(TrainJob(shards=shards, out=args.out / "train", config=config, backbone=args.backbone,
                                gt=args.train_masks, progress=args.progress),
                       log=lambda line: print(line, file=sys.stderr))
    times["saliency train"] = time.perf_counter() - mark
    mark = time.perf_counter()
    maps, mean = heldout_maps(args.heldout_images, args.out, config, args.progress)
    times["held-out maps"] = time.perf_counter() - mark
    mark = time.perf_counter()
    rows = score_rows(args.out / "train" / MODEL_NAME, args.heldout_images, args.heldout_masks, maps, mean, config)
    times["scoring"] = time.perf_counter() - mark
    times["total"] = time.perf_counter() - start

    print(f"config {config.preset} {' '.join(args.overrides)}; backbone {args.backbone}; "
          f"training images {', '.join(map(str, args.train_images))}")
    print(format_rows(rows))
    if args.train_masks is not None:
        print(format_report(report))
    print("wall s: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

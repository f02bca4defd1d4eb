"""`saliency build-masks` throughput next to the bare network forward pass at the same batch and size.

The job's overhead (reading, decoding, resizing, PNG encoding, tar writing) should cost at most 20%
of the forward pass alone: ratio = job images/s / forward images/s >= 0.8. The forward baseline
is measured before and after the job in the same process (median of the two), so a change in the
machine's load during the run shows up as a spread rather than a false ratio.

    python benchmarks/bench_build_masks.py --shards SHARDS [--model model.pt] [--size 64] [--batch 32]
        [--workers 2] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from saliency.network.build_masks import BuildMasksConfig, MaskPredictor, build_masks
from saliency.network.model import SaliencyNet
from saliency.network.model_file import save_model
from shards import read_manifest
from shards.build import Ranks


def forward_images_per_s(predictor: MaskPredictor, count: int, batch: int) -> float:
    """Images/s of the bare forward pass (uint8 squares in, probabilities out) on `count` images."""
    import numpy as np

    rng = np.random.default_rng(0)
    squares = [rng.integers(0, 256, (predictor.size, predictor.size, 3), dtype=np.uint8) for _ in range(batch)]
    predictor(squares)  # warm-up
    done, start = 0, time.perf_counter()
    while done < count:
        predictor(squares[: min(batch, count - done)])
        done += min(batch, count - done)
    if predictor.cuda:
        torch.cuda.synchronize()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="model.pt (default: a random ResNet-18 model at --size)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="bench-build-masks-"))
    try:
        model_path = args.model
        if model_path is None:
            torch.manual_seed(0)
            model_path = save_model(scratch / "model.pt", SaliencyNet(18).eval(), input_size=args.size,
                                    preset="bench", backbone="random", config={}, report={})
        predictor = MaskPredictor(model_path, args.device)
        count = read_manifest(args.shards).num_rows
        before = forward_images_per_s(predictor, count, args.batch)
        config = BuildMasksConfig(model=model_path, shards=args.shards, out=scratch / "masked", workers=args.workers,
                                  batch_size=args.batch, device=args.device, progress=False)
        start = time.perf_counter()
        summary = build_masks(config, Ranks(), predictor=predictor)
        job = summary["written"] / (time.perf_counter() - start)
        after = forward_images_per_s(predictor, count, args.batch)
        forward = statistics.median([before, after])
        print(f"images {count}, input {predictor.size} px, batch {args.batch}, workers {args.workers}, "
              f"threads {args.threads}, device {args.device}")
        print(f"forward only: {before:.1f} / {after:.1f} img/s (before / after the job)")
        print(f"build-masks:  {job:.1f} img/s ({summary['written']} masked, {summary['rejected']} rejected)")
        print(f"ratio build-masks / forward: {job / forward:.2f} (target >= 0.8)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

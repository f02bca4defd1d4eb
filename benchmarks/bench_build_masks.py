"""`saliency build-masks` throughput next to the bare network forward pass at the same batch and size.

The job's overhead (reading, decoding, resizing, PNG encoding, tar writing) should cost at most 20%
of the forward pass alone: ratio = job images/s / forward images/s >= 0.8. The forward baseline
is measured before and after the job in the same process (median of the two), so a change in the
machine's load during the run shows up as a spread rather than a false ratio.

Where the overhead goes: the job's host CPU time per image (all threads, `time.process_time`), the
host ceiling it implies on the cores the job can use, and where the main thread waited (for the
forward: GPU-bound; for the pool: host-bound).

`--stand-in-forward-ms MS` (a simulation, labelled as such in the output) replaces the network by a
stand-in whose forward takes MS per batch with the GIL released, as a GPU does, so that a CPU machine
shows whether the host work would hide under a forward of that cost.

    python benchmarks/bench_build_masks.py --shards SHARDS [--model model.pt] [--size 64] [--batch 32]
        [--workers 2] [--threads 1] [--device cpu] [--stand-in-forward-ms MS]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from saliency.network.build_masks import BuildMasksConfig, MaskPredictor, build_masks
from saliency.network.model import SaliencyNet
from saliency.network.model_file import save_model
from shards import read_manifest
from shards.build import Ranks


def forward_images_per_s(predictor: MaskPredictor, count: int, batch: int) -> float:
    """Images/s of the bare forward pass (uint8 squares in, probabilities out) on `count` images."""
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


class StandInForward:
    """A simulated network: each batch takes `seconds` from its launch (a sleep: the GIL is released, as
    in a CUDA wait) and returns a fixed smooth probability map per image, as a fresh float32 array
    like the copy back from a GPU."""

    def __init__(self, size: int, seconds: float):
        self.size, self.seconds = size, seconds
        ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
        self.map = np.clip(np.add.outer(ramp, ramp) - 0.5, 0.0, 1.0)  # smooth, like a network's upsampled output

    def launch(self, squares: list[np.ndarray]):
        until = time.perf_counter() + self.seconds

        def wait() -> np.ndarray:
            time.sleep(max(0.0, until - time.perf_counter()))
            return np.repeat(self.map[None], len(squares), axis=0)

        return wait

    def __call__(self, squares: list[np.ndarray]) -> np.ndarray:
        return self.launch(squares)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="model.pt (default: a random ResNet-18 model at --size)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stand-in-forward-ms", type=float, default=None,
                        help="SIMULATION: replace the network by a stand-in taking this many ms per batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    simulated = args.stand_in_forward_ms is not None
    scratch = Path(tempfile.mkdtemp(prefix="bench-build-masks-"))
    try:
        model_path = args.model
        if model_path is None:
            torch.manual_seed(0)
            model_path = save_model(scratch / "model.pt", SaliencyNet(18).eval(), input_size=args.size,
                                    preset="bench", backbone="random", config={}, report={})
        count = read_manifest(args.shards).num_rows
        if simulated:
            predictor = StandInForward(args.size, args.stand_in_forward_ms / 1000)
        else:
            predictor = MaskPredictor(model_path, args.device)
            before = forward_images_per_s(predictor, count, args.batch)
        config = BuildMasksConfig(model=model_path, shards=args.shards, out=scratch / "masked", workers=args.workers,
                                  batch_size=args.batch, device=args.device, progress=False)
        start, cpu_start = time.perf_counter(), time.process_time()
        summary = build_masks(config, Ranks(), predictor=predictor)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        job = summary["written"] / seconds
        device = "SIMULATED (stand-in forward, no network)" if simulated else args.device
        print(f"images {count}, input {predictor.size} px, batch {args.batch}, workers {args.workers}, "
              f"threads {args.threads}, device {device}")
        if simulated:
            forward = args.batch / (args.stand_in_forward_ms / 1000)
            print(f"SIMULATED forward: {args.stand_in_forward_ms:g} ms per batch = {forward:.1f} img/s (set, not measured)")
        else:
            after = forward_images_per_s(predictor, count, args.batch)
            forward = statistics.median([before, after])
            print(f"forward only: {before:.1f} / {after:.1f} img/s (before / after the job)")
        label = "build-masks (SIMULATED forward)" if simulated else "build-masks"
        print(f"{label}: {job:.1f} img/s ({summary['written']} masked, {summary['rejected']} rejected)")
        print(f"ratio build-masks / forward: {job / forward:.2f} (target >= 0.8)")
        host_ms = 1000 * cpu_seconds / max(1, summary["written"])
        cores = min(args.workers + 1, os.cpu_count() or 1)
        included = "" if simulated or args.device.startswith("cuda") else ", the CPU forward included"
        print(f"host CPU: {host_ms:.2f} ms per image (all threads{included}); {cpu_seconds / seconds:.2f} cores busy "
              f"on average; ceiling on {cores} cores (workers + main thread): {cores * 1000 / host_ms:.0f} img/s")
        main_s = summary["main_thread_s"] or 1e-9
        print(f"main thread: {summary['main_thread_s']:.2f} s, in the forward (launch + wait) "
              f"{summary['forward_s'] / main_s:.0%}, for the pool (decode, masks) "
              f"{summary['waiting_for_pool_s'] / main_s:.0%}, the rest its own work (reading, tar writing)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

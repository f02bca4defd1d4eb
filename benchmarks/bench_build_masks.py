"""`saliency build-masks` throughput next to the bare network forward pass at the same batch and size.

The job's overhead (reading, decoding, resizing, PNG encoding, tar writing) should cost at most 20%
of the forward pass alone: ratio = job images/s / forward images/s >= 0.8. The forward baseline
is measured before and after the job in the same process (median of the two), so a change in the
machine's load during the run shows up as a spread rather than a false ratio.

Where the overhead goes: the job's host CPU time per image (its process and its worker processes),
the host ceiling it implies on the cores the job can use; the job's own process's CPU per image (the
serial part: reading, the network's launches, tar writing) and the ceiling that sets whatever the
cores; and where the main thread waited (for the forward: GPU-bound; for the pool: host-bound).

`--stand-in-forward-ms MS` (a simulation, labelled as such in the output) replaces the network by a
stand-in whose forward takes MS per batch with the GIL released, as a GPU does, so that a CPU machine
shows whether the host work would hide under a forward of that cost.

    python benchmarks/bench_build_masks.py --shards SHARDS [--model model.pt] [--size 64] [--batch 32]
        [--workers 2] [--threads 1] [--device cpu] [--stand-in-forward-ms MS]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

# torch and the project are imported in the functions that use them: the job's worker processes are
# spawned, and each imports this script first (as `__mp_main__`), as they import the light `relicv2` script.


def forward_images_per_s(predictor, count: int, batch: int) -> float:
    """Images/s of the bare forward pass (uint8 squares in, probabilities out) on `count` images, at its
    best: from and into a block page-locked for the GPU's DMA, as the job's ring is (no host copies)."""
    import torch

    from relicv2.saliency.network.mask_work import SlotRing

    ring = SlotRing.create(batch, predictor.size)
    locked = predictor.register_host_memory(*ring.address())
    squares, out = ring.squares(0), ring.probabilities(0)
    try:
        squares[...] = np.random.default_rng(0).integers(0, 256, squares.shape, dtype=np.uint8)
        predictor.launch(squares, out)()  # warm-up
        done, start = 0, time.perf_counter()
        while done < count:
            part = min(batch, count - done)
            predictor.launch(squares[:part], out[:part])()
            done += part
        if predictor.cuda:
            torch.cuda.synchronize()
        return count / (time.perf_counter() - start)
    finally:
        del squares, out
        if locked:
            predictor.unregister_host_memory()
        ring.release()


class StandInForward:
    """A simulated network on a GPU: each batch takes `seconds` from its launch (a sleep: the GIL is
    released, as in a CUDA wait). Its host work is what the real path's is with the job's ring
    page-locked: none. Squares go up and maps come down by DMA, so the stand-in copies nothing; it
    writes its fixed smooth map into each slot of the ring once (the map is the same for every batch)."""

    def __init__(self, size: int, seconds: float):
        self.size, self.seconds = size, seconds
        ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
        self.map = np.clip(np.add.outer(ramp, ramp) - 0.5, 0.0, 1.0)  # smooth, like a network's upsampled output
        self.filled: set[tuple[int, int]] = set()

    def launch(self, squares: np.ndarray, out: np.ndarray):
        until = time.perf_counter() + self.seconds
        if (out.ctypes.data, len(out)) not in self.filled:
            out[...] = self.map
            self.filled.add((out.ctypes.data, len(out)))

        def wait() -> np.ndarray:
            time.sleep(max(0.0, until - time.perf_counter()))
            return out

        return wait


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process, and of its finished child processes (the job's workers, once the
    job has returned: its pool is shut down and joined by then)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def main() -> None:
    import torch

    from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks
    from relicv2.saliency.network.config import default_workers
    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model
    from relicv2.saliency.network.predictor import MaskPredictor
    from relicv2.shards.build import Ranks
    from relicv2.shards.shardset import resolve_shard_set

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="model.pt (default: a random ResNet-18 model at --size)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: the job's default)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stand-in-forward-ms", type=float, default=None,
                        help="SIMULATION: replace the network by a stand-in taking this many ms per batch")
    args = parser.parse_args()
    workers = default_workers() if args.workers is None else args.workers
    torch.set_num_threads(args.threads)
    simulated = args.stand_in_forward_ms is not None
    scratch = Path(tempfile.mkdtemp(prefix="bench-build-masks-"))
    try:
        model_path = args.model
        if model_path is None:
            torch.manual_seed(0)
            model_path = save_model(scratch / "model.pt", SaliencyNet(18).eval(), input_size=args.size,
                                    preset="bench", backbone="random", config={}, report={})
        count = resolve_shard_set(args.shards).samples  # any set build-masks takes (plain tars too)
        if simulated:
            predictor = StandInForward(args.size, args.stand_in_forward_ms / 1000)
        else:
            predictor = MaskPredictor(model_path, args.device)
            before = forward_images_per_s(predictor, count, args.batch)
        config = BuildMasksConfig(model=model_path, shards=args.shards, out=scratch / "masked", workers=workers,
                                  batch_size=args.batch, device=args.device, progress=False)
        start, (own_start, children_start) = time.perf_counter(), cpu_seconds()
        summary = build_masks(config, Ranks(), predictor=predictor)
        seconds, (own_end, children_end) = time.perf_counter() - start, cpu_seconds()
        own_cpu, all_cpu = own_end - own_start, own_end - own_start + children_end - children_start
        job = summary["written"] / seconds
        device = "SIMULATED (stand-in forward, no network)" if simulated else args.device
        print(f"images {count}, input {predictor.size} px, batch {args.batch}, workers {workers}, "
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
        # The workers start once per job (a spawned process imports numpy, OpenCV, PIL): nothing over ImageNet,
        # a share of a benchmark's few thousand images.
        first = summary["first_batch_s"] or 0.0
        steady = summary["written"] / max(1e-9, seconds - first)
        print(f"without the start (first batch decoded after {first:.2f} s, the workers' start included): "
              f"{steady:.1f} img/s, ratio {steady / forward:.2f}")
        written = max(1, summary["written"])
        host_ms, own_ms = 1000 * all_cpu / written, 1000 * own_cpu / written
        cores = min(workers + 1, os.cpu_count() or 1)
        included = "" if simulated or args.device.startswith("cuda") else ", the CPU forward included"
        print(f"host CPU: {host_ms:.2f} ms per image (the job's process and its workers{included}); "
              f"{all_cpu / seconds:.2f} cores busy on average; ceiling on {cores} cores (workers + the job's "
              f"process): {cores * 1000 / host_ms:.0f} img/s")
        print(f"the job's own process: {own_ms:.2f} CPU ms per image, a ceiling of {1000 / own_ms:.0f} img/s "
              f"whatever the cores (reading, the network's launches, tar writing, the pool's hand-overs{included})")
        if not simulated:
            print(f"the job's ring page-locked for the GPU's DMA: {summary['ring_page_locked']} (False on a CPU)")
        main_s = summary["main_thread_s"] or 1e-9
        print(f"main thread: {summary['main_thread_s']:.2f} s, in the forward (launch + wait) "
              f"{summary['forward_s'] / main_s:.0%}, for the pool (decode, masks) "
              f"{summary['waiting_for_pool_s'] / main_s:.0%}, the rest its own work (reading, tar writing)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

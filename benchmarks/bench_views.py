"""Images/s of the view pipeline: DALI vs the PIL/torchvision DataLoader reference, side by side.

Builds a masked shard set from `../shared/data/msra-unlabeled` in a temporary folder (the photos'
JPEG bytes as they are, plus a synthetic soft elliptic mask per image so mask decoding, cropping
and blending are part of the work), then times each backend producing the paper's views
(4 x 224 + 2 x 96 by default) for a number of batches after a warm-up.

    python benchmarks/bench_views.py                      # DALI CPU vs reference, 2 threads/workers
    python benchmarks/bench_views.py --device cuda        # DALI mixed (GPU) vs reference
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pretrain.views.loader import ViewLoader
from shards import ShardSample, write_shard_set

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "msra-unlabeled"


def soft_ellipse(width: int, height: int, rng: np.random.Generator) -> bytes:
    """An 8-bit PNG soft mask: an ellipse covering roughly 20-50% of the image, blurred edge."""
    y, x = np.mgrid[0:height, 0:width]
    cy, cx = height * rng.uniform(0.4, 0.6), width * rng.uniform(0.4, 0.6)
    ry, rx = height * rng.uniform(0.25, 0.4), width * rng.uniform(0.25, 0.4)
    d = np.sqrt(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2)
    mask = (np.clip((1.1 - d) / 0.2, 0, 1) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, "PNG")
    return buffer.getvalue()


def build_masked_shards(source: Path, out: Path, limit: int) -> int:
    rng = np.random.default_rng(0)
    samples = []
    for path in sorted(source.glob("*.jpg"))[:limit]:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
        samples.append(ShardSample(path.stem, {"jpg": data, "mask.png": soft_ellipse(width, height, rng)}, None,
                                   {"width": width, "height": height}))
    write_shard_set(samples, out, prefix="masked", max_count=250)
    return len(samples)


def timed(shards: Path, backend: str, device: str, threads: int, args, **options) -> tuple[float, float, int]:
    """(images/s wall clock, CPU ms per image of this process, images timed)."""
    loader = ViewLoader(shards, args.batch, backend=backend, device=device, num_threads=threads,
                        large_size=args.large_size, small_size=args.small_size, seed=1, **options)
    batches = iter(loader)
    for _ in range(args.warmup):
        next(batches)
    start, cpu = time.perf_counter(), time.process_time()
    done = 0
    for _ in range(args.batches):
        batch = next(batches)
        if device != "cpu":
            batch["views"][-1].sum().item()  # wait for the GPU
        done += len(batch["keys"])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return done / wall, 1000 * cpu / done, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (DALI CPU operators) or cuda (DALI mixed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads and reference DataLoader workers")
    parser.add_argument("--batches", type=int, default=6, help="timed batches per backend")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--large-size", type=int, default=224)
    parser.add_argument("--small-size", type=int, default=96)
    parser.add_argument("--backends", default="dali,reference")
    parser.add_argument("--hue-models", default="hsv,yiq", help="DALI hue operations to time (hsv exact, yiq fast)")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if not args.data.is_dir():
        raise SystemExit(f"{args.data} not found; pass --data with a folder of JPEG photos")
    with tempfile.TemporaryDirectory(prefix="bench-views-") as tmp:
        start = time.perf_counter()
        count = build_masked_shards(args.data, Path(tmp), args.images)
        print(f"built {count} masked samples in {time.perf_counter() - start:.1f} s")
        print(f"views: 4 x {args.large_size} + 2 x {args.small_size}, batch {args.batch}, {args.threads} threads/workers")
        wall, cpu = {}, {}
        runs = [("reference", "reference", {})] if "reference" in args.backends.split(",") else []
        if "dali" in args.backends.split(","):
            runs = [(f"dali-{h}", "dali", {"hue_model": h}) for h in args.hue_models.split(",")] + runs
        for name, backend, options in runs:
            device = args.device if backend == "dali" else "cpu"
            wall[name], ms, done = timed(Path(tmp), backend, device, args.threads, args, **options)
            if backend == "reference":
                # DataLoader workers are other processes: measure CPU cost per image in-process.
                torch.set_num_threads(1)
                _, ms, _ = timed(Path(tmp), backend, device, 1, args)
            cpu[name] = ms
            print(f"{name:9s} ({device}): {wall[name]:7.1f} images/s wall, {ms:6.1f} CPU ms/image "
                  f"({done} images timed)")
        for name in wall:
            if name != "reference" and "reference" in wall:
                print(f"{name} / reference: {wall[name] / wall['reference']:.2f}x wall clock, "
                      f"{cpu['reference'] / cpu[name]:.2f}x by CPU time per image")
        print(f"load average at the end: {os.getloadavg()[0]:.1f} (the machine is shared: wall figures vary)")


if __name__ == "__main__":
    main()

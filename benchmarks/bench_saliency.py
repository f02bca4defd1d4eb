"""Seconds per image of each handcrafted saliency method on one core, next to the reference.

Runs every method on the first N PASCAL-S dev images, resized to 400x300 (the design's budget
size) or at their own size (``--native``), in this one process with BLAS/OpenCV limited to one
thread. Reports CPU seconds (``process_time``, robust to other jobs on a shared machine) and
wall seconds per image, median over images, after one warm-up call.

    .venv/bin/python benchmarks/bench_saliency.py                 # 20 images, all methods
    .venv/bin/python benchmarks/bench_saliency.py --methods rbd,mr --images 50 --native
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # before numpy is imported: one core, as the reference timings

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import cv2  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.saliency.handcrafted import resolve_methods  # noqa: E402
from relicv2.saliency.handcrafted.methods import METHODS  # noqa: E402
from relicv2.saliency.images import read_rgb  # noqa: E402
from tests.paths import SHARED_DATA  # noqa: E402

DATA = SHARED_DATA / "pascal-s-dev" / "images"
# data/README.md: one thread, ECSSD-sized images; MR is the authors' C++, the others their
# MATLAB code under Octave. Targets from the issue.
REFERENCE = {"rbd": 0.107, "mr": 0.035, "dsr": 9.8, "mc": 1.30}
TARGET = {"rbd": 0.10, "mr": 0.07, "dsr": 0.5, "mc": 0.10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all")
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--native", action="store_true", help="keep the images' own size")
    parser.add_argument("--data", type=Path, default=DATA, help="folder of JPEGs (default: the shared dev images)")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    paths = sorted(args.data.glob("*.jpg"))[: args.images]
    if not paths:
        sys.exit(f"no images found in {args.data}; pass --data")
    images = [read_rgb(p) for p in paths]
    if not args.native:
        images = [cv2.resize(im, (400, 300), interpolation=cv2.INTER_AREA) for im in images]
    size = "native size" if args.native else "400x300"
    print(f"{len(images)} PASCAL-S dev images, {size}, one thread, load average {os.getloadavg()[0]:.1f}")
    print("| method | CPU s/img (median) | wall s/img (median) | reference s/img | target |")
    print("|---|---|---|---|---|")
    for method in resolve_methods(args.methods):
        function = METHODS[method]
        function(images[0])  # warm-up: imports, allocator
        cpu, wall = [], []
        for image in images:
            c0, w0 = time.process_time(), time.perf_counter()
            function(image)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        print(
            f"| {method} | {np.median(cpu):.3f} | {np.median(wall):.3f} | {REFERENCE[method]:.3f} "
            f"| <= {TARGET[method]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

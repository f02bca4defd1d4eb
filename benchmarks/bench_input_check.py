"""What a rerun of `relicv2 shards build` pays to tell an edited input: by time (the default) or by content.

Lists a real image folder as the build does (`shards.sources.list_inputs`: a walk and a stat() a file, which a
build pays anyway), then computes the done records' input identity both ways (`shards.job.input_files_identity`):
"time" digests the modification times the listing already read; "content" reads and hashes every file. Figures
are medians of --repeats on a warm page cache (a cold disk adds its read time to "content" only); the cost of
"content" is fitted per file and per byte over the files' sizes, and extrapolated to a million images of
ImageNet's mean file size (~110 KiB).

    .venv/bin/python benchmarks/bench_input_check.py [--data DIR ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from relicv2.shards.job import input_files_identity, sha256_of  # noqa: E402
from relicv2.shards.sources import list_inputs  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA = [SHARED / "msra-unlabeled", SHARED / "imagenette-112" / "train"]
IMAGENET_MEAN_BYTES = 110 * 1024  # 1.28 M files, ~140 GB


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hash_cost(files: list[tuple[str, int]], repeats: int) -> tuple[float, float]:
    """(seconds a file, seconds a byte) of reading and hashing one file: a line fitted to each file's fastest time."""
    sizes = np.array([Path(path).stat().st_size for path, _ in files], dtype=float)
    fastest = np.full(len(files), np.inf)
    for _ in range(repeats):
        for i, (path, _) in enumerate(files):
            start = time.perf_counter()
            sha256_of(Path(path))
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    per_byte, per_file = np.polyfit(sizes, fastest, 1)
    return per_file, per_byte


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", default=DATA)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    files, listed, mib = [], 0.0, 0.0
    for folder in args.data:
        listing = list_inputs(folder)
        files += [(im.path, im.mtime_ns) for im in listing.images]
        mib += sum(im.size for im in listing.images) / 2**20
        listed += median_seconds(lambda folder=folder: list_inputs(folder), args.repeats)
    input_files_identity(files, "content")  # warm the page cache: the figures compare work, not the disk
    by_time = median_seconds(lambda: input_files_identity(files, "time"), args.repeats)
    by_content = median_seconds(lambda: input_files_identity(files, "content"), args.repeats)
    per_file, per_byte = hash_cost(files, args.repeats)
    n = len(files)
    stat_million = 1e6 * (listed + by_time) / n
    content_million = stat_million + 1e6 * (per_file + per_byte * IMAGENET_MEAN_BYTES)
    print(f"{n} files, {mib:.1f} MiB (mean {mib * 1024 / n:.1f} KiB) in {', '.join(str(d) for d in args.data)}")
    print(f"listing (walk + stat, paid by every build): {1e6 * listed / n:.1f} us/file")
    print(f"identity by time (digest of the listed times): {1e6 * by_time / n:.2f} us/file")
    print(f"identity by content (read + SHA-256): {1e6 * by_content / n:.1f} us/file; fitted "
          f"{1e6 * per_file:.1f} us/file + {per_byte * 2**20 * 1e3:.2f} ms/MiB")
    print(f"content / (listing + time): {(listed + by_content) / (listed + by_time):.1f}x on these files")
    print(f"per million images of ImageNet's mean size (110 KiB), warm cache: listing + time {stat_million:.1f} s, "
          f"listing + content {content_million:.0f} s ({content_million / stat_million:.0f}x)")


if __name__ == "__main__":
    main()

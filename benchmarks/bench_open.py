"""Opening a shard set in a view loader: the first open (every sample checked) vs a later one
(the verdicts kept in the index cache), for a set from `shards build` and a plain copy of it;
then the memory the loader holds per sample for the whole run.

What a `pretrain` rank pays at every start before its first batch, per sample. The floor is the
bare parse of the index files (`shards.read_index`), measured in the same run; figures are
microseconds per sample, medians of --repeats, and ratios to that floor. The memory is traced
(`tracemalloc`) for the loader's `SampleTable` and, as the baseline, for the same samples as a
list of `SampleRef` objects (what loaders held before the table).

    .venv/bin/python benchmarks/bench_open.py [--data DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.shards import read_index, resolve_shard_set  # noqa: E402
from relicv2.shards.build import BuildConfig, build_shards  # noqa: E402
from relicv2.shards.checks import CHECKS_FOLDER  # noqa: E402
from relicv2.shards.sample_set import load_sample_set  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "imagenette-112" / "train"


def timed(fn, repeats: int, before=None) -> float:
    """Median seconds of `fn()` over `repeats` runs, `before()` run untimed ahead of each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def held_bytes(make) -> int:
    """Bytes of memory still allocated when `make()`'s result is alive (its temporaries freed)."""
    gc.collect()
    tracemalloc.start()
    kept = make()
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="an image folder (class sub-folders or flat)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"{args.data} is not a folder; pass --data with an image folder")
    with tempfile.TemporaryDirectory() as tmp:
        own, plain, cache = Path(tmp) / "own", Path(tmp) / "plain", Path(tmp) / "cache"
        build_shards(BuildConfig(input=args.data, out_dir=own, workers=2, max_count=2000, progress=False))
        plain.mkdir()
        for tar in sorted(own.glob("*.tar")):
            shutil.copy(tar, plain / tar.name.replace("images-", "train-"))
        resolve_shard_set(plain, index_cache=cache)  # derive the plain copy's indexes once, outside the timing
        samples = resolve_shard_set(own).samples
        forget = lambda: shutil.rmtree(cache / CHECKS_FOLDER, ignore_errors=True)  # noqa: E731
        rows = []
        for name, spec in (("shards build set", own), ("plain WebDataset copy", plain)):
            files = resolve_shard_set(spec, index_cache=cache)
            floor = timed(lambda f=files: [read_index(i, t) for t, i in zip(f.tars, f.index_files, strict=True)],
                          args.repeats)
            first = timed(lambda s=spec: load_sample_set(s, index_cache=cache), args.repeats, before=forget)
            load_sample_set(spec, index_cache=cache)
            later = timed(lambda s=spec: load_sample_set(s, index_cache=cache), args.repeats)
            rows.append((name, floor, first, later))
        table = load_sample_set(own, index_cache=cache).samples
        as_table = held_bytes(lambda: load_sample_set(own, index_cache=cache).samples)
        as_list = held_bytes(lambda: list(table))
    per = 1e6 / samples
    print(f"{samples} samples from {args.data}; microseconds per sample (x the index parse)")
    print(f"{'set':<24}{'index parse':>12}{'first open':>18}{'later open':>18}{'first/later':>13}")
    for name, floor, first, later in rows:
        print(f"{name:<24}{floor * per:>12.1f}{first * per:>10.1f} ({first / floor:4.1f}x)"
              f"{later * per:>10.1f} ({later / floor:4.1f}x){first / later:>12.1f}x")
    print(f"held per sample: {as_table / samples:.0f} B as a SampleTable ({table.nbytes() / samples:.0f} B of columns), "
          f"{as_list / samples:.0f} B as a list of SampleRef ({as_list / as_table:.1f}x)")


if __name__ == "__main__":
    main()

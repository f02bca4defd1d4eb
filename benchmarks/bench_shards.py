"""Shard-building throughput: `shards.build` vs a plain `webdataset.ShardWriter` loop.

Both read the 1,000 JPEGs of ../shared/data/msra-unlabeled and decode-verify every image the same
way: PIL `Image.open(...).load()`, a full decode (no `draft()` reduced-size shortcut). Both store
the original bytes. `shards.build` also shuffles, hashes, writes DALI indices, manifests and
done-markers; it runs with --workers processes, the baseline in one process (a plain loop).

Then reading the built set back: `shards.iter_samples` (the project's own tar reader: opened as a
file, members checked and capped, losses counted) vs iterating `webdataset.WebDataset` over the
same tars (what iter_samples used before), in samples/s and as a ratio.

    .venv/bin/python benchmarks/bench_shards.py [--workers 2] [--repeats 3] [--data DIR]

--digest measures the plan's per-shard digest instead (no images needed): CPU seconds of
`shards.plan.shard_digest` against `reference_digest` (one json.dumps an input, the same bytes) over
200,000 ImageNet-like inputs; every rank of a build digests every shard of the plan.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from relicv2.shards.build import BuildConfig, build_shards
from relicv2.shards.plan import reference_digest, shard_digest
from relicv2.shards.sources import SourceImage

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "msra-unlabeled"


def baseline(images: list[Path], out: Path) -> int:
    """A plain webdataset.ShardWriter loop with the same decode check."""
    import webdataset as wds

    written = 0
    with wds.ShardWriter(str(out / "base-%06d.tar"), maxsize=1 << 30, verbose=0) as sink:
        for path in images:
            data = path.read_bytes()
            try:
                Image.open(io.BytesIO(data)).load()
            except Exception:
                continue
            sink.write({"__key__": path.stem, "jpg": data})
            written += 1
    return written


def ours(source: Path, out: Path, workers: int) -> int:
    """`relicv2 shards build SOURCE --out OUT --workers N` as a library call."""
    report = build_shards(BuildConfig(input=source, out_dir=out, workers=workers, progress=False))
    return report.merge.written


def read_ours(out: Path) -> int:
    """Samples delivered by shards.iter_samples over a built set (with a ReadReport)."""
    from relicv2.shards import ReadReport, iter_samples

    report = ReadReport()
    count = sum(1 for _ in iter_samples(out, report=report))
    assert report.ok, report.summary()
    return count


def read_webdataset(out: Path) -> int:
    """Samples delivered by webdataset.WebDataset over the same tars (the previous reader)."""
    import webdataset as wds

    urls = [str(p) for p in sorted(out.glob("images-*.tar"))]
    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False)
    return sum(1 for _ in dataset)


def timed_read(read, out: Path) -> float:
    start = time.perf_counter()
    count = read(out)
    return count / (time.perf_counter() - start)


def timed(run, out: Path) -> tuple[float, int]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    start = time.perf_counter()
    count = run(out)
    return time.perf_counter() - start, count


def digest_ratio(repeats: int, count: int = 200_000) -> int:
    """CPU seconds of shard_digest and reference_digest (interleaved; the best of `repeats` each)."""
    images = [SourceImage(f"n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", f"/data/{i}", i % 1000, f"n{i % 1000:08d}",
                          100_000 + i, f"n{i % 1000:08d}_{i}") for i in range(count)]
    spent: dict[str, list[float]] = {"shard_digest": [], "reference_digest": []}
    for _ in range(repeats):
        for name, digest in (("shard_digest", shard_digest), ("reference_digest", reference_digest)):
            start = time.process_time()
            digest(images, {"quality": 95})
            spent[name].append(time.process_time() - start)
    for name, seconds in spent.items():
        print(f"{name:<17} {count:,} inputs: best {min(seconds):.3f} CPU s")
    print(f"shard_digest / reference_digest (best): {min(spent['shard_digest']) / min(spent['reference_digest']):.2f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--digest", action="store_true", help="measure the plan's shard digest instead")
    args = parser.parse_args()
    if args.digest:
        return digest_ratio(args.repeats)
    images = sorted(args.data.glob("*.jpg"))
    if not images:
        print(f"no JPEGs in {args.data}; the benchmark needs ../shared/data/msra-unlabeled", file=sys.stderr)
        return 1
    for p in images:  # warm the page cache so neither side pays the first disk read
        p.read_bytes()
    import webdataset  # noqa: F401  (imported once here so neither timing includes it)

    results: dict[str, list[float]] = {"shards build": [], "ShardWriter loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved, so machine load affects both alike
            seconds, n = timed(lambda out: ours(args.data, out, args.workers), Path(tmp) / "ours")
            results["shards build"].append(n / seconds)
            seconds, n = timed(lambda out: baseline(images, out), Path(tmp) / "base")
            results["ShardWriter loop"].append(n / seconds)
        reads: dict[str, list[float]] = {"iter_samples": [], "WebDataset": []}
        for _ in range(args.repeats):
            reads["iter_samples"].append(timed_read(read_ours, Path(tmp) / "ours"))
            reads["WebDataset"].append(timed_read(read_webdataset, Path(tmp) / "ours"))
    print(f"{len(images)} images from {args.data.name}, decode check: PIL Image.open().load() (full decode)")
    print(f"{'method':<20} {'workers':>7} {'median img/s':>13} {'best img/s':>11}")
    for name, rates in results.items():
        workers = args.workers if name == "shards build" else 1
        print(f"{name:<20} {workers:>7} {statistics.median(rates):>13.0f} {max(rates):>11.0f}")
    print(f"{'reader':<20} {'median samples/s':>17} {'best':>8}")
    for name, rates in reads.items():
        print(f"{name:<20} {statistics.median(rates):>17.0f} {max(rates):>8.0f}")
    ratio = statistics.median(reads["iter_samples"]) / statistics.median(reads["WebDataset"])
    print(f"iter_samples / WebDataset (median): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

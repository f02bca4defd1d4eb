"""ImageNet-sized rehearsal of every job's bookkeeping: start-up, planning, memory and per-sample overhead.

Everything that scales with the number of samples or tars (tar and index handling, manifests, sample
checks, per-rank splits, loaders' tables, merges) is exercised on a set shaped like ImageNet's training
split: 1,281,167 samples in 1,000 classes, ImageNet's file names (`nXXXXXXXX/nXXXXXXXX_N.JPEG`),
tiny but valid JPEGs of varied sizes and a few hundred awkward samples (CMYK, greyscale, a PNG named
.JPEG, EXIF-rotated, truncated, empty, too small). Pixels are made negligible, so what the figures
show is the bookkeeping.

The set is made once in DIR and reused (DIR/images: the image folder; DIR/shards: the project's own
shards, built by the first `shards build` row; DIR/plain: a plain WebDataset set, no index files).
Each job runs as its own process under a probe that records its wall time, CPU time (its workers
included), peak RSS (largest process), the files its main process opened and the bytes it read.

    python benchmarks/scale_rehearsal.py --out DIR [--samples N] [--quick] [--jobs build,index,...]

`--quick` is 100,000 samples. Run at 10 k, 100 k and 1.28 M to see the curve (each size its own DIR).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

IMAGENET_TRAIN = 1_281_167
IMAGENET_CLASSES = 1_000
QUICK = 100_000
SAMPLES_PER_TAR = 1_282  # ~1,000 tars at ImageNet's size, as the paper-scale builds make them
AWKWARD_EVERY = 4_000  # ~320 awkward samples at ImageNet's size
SIDES = (32, 40, 48, 56, 64)  # shorter sides: every image passes the default --min-side of 32
JOBS = ("build", "index", "verify", "subset", "pretrain-start", "report")

# Runs a relicv2 command in this process with an audit hook that counts the files it opens, then
# writes what /proc says it read; the parent takes CPU and peak RSS from wait4 (workers included).
PROBE = r"""
import json, sys
opened = [0]
def hook(event, args):
    if event == "open":
        opened[0] += 1
sys.addaudithook(hook)
from cli.main import cli
code = 0
try:
    cli(sys.argv[2:], prog_name="relicv2")
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
finally:
    io_stats = {}
    try:
        for line in open("/proc/self/io"):
            name, value = line.split(":")
            io_stats[name] = int(value)
    except OSError:
        pass
    with open(sys.argv[1], "w") as handle:
        json.dump({"opened": opened[0], "rchar": io_stats.get("rchar", 0), "code": code}, handle)
"""


@dataclass
class Measured:
    job: str
    samples: int
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    opened: int
    read_mb: float
    code: int

    def row(self) -> str:
        per_sample_us = self.wall_s / max(self.samples, 1) * 1e6
        return (f"| {self.job} | {self.samples:,} | {self.wall_s:.1f} | {self.cpu_s:.1f} | {per_sample_us:.1f} | "
                f"{self.peak_rss_mb:,.0f} | {self.opened:,} | {self.read_mb:,.0f} | {self.code} |")


HEADER = ("| job | samples | wall s | CPU s | wall us/sample | peak RSS MB | files opened | MB read | exit |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def wnid(index: int) -> str:
    """A synset id shaped like ImageNet's (n + 8 digits), stable for a class index."""
    return f"n{1440764 + index * 9973:08d}"


def tiny_jpegs(seed: int) -> list[bytes]:
    """A pool of tiny valid JPEGs of varied sizes (copied per sample: encoding is not what is measured)."""
    rng = random.Random(seed)
    pool = []
    for side in SIDES:
        for _ in range(8):
            long_side = side + rng.randrange(0, side)
            size = (long_side, side) if rng.random() < 0.5 else (side, long_side)
            image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=80)
            pool.append(buffer.getvalue())
    return pool


def awkward_samples() -> dict[str, bytes]:
    """The kinds of file ImageNet and users' folders really hold, each a few times over the set."""
    def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **kwargs)
        return buffer.getvalue()

    rgb = Image.new("RGB", (48, 40), (200, 30, 30))
    rotated = rgb.copy()
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 on display
    good = encoded(rgb, "JPEG")
    return {
        "cmyk": encoded(rgb.convert("CMYK"), "JPEG"),
        "grey": encoded(rgb.convert("L"), "JPEG"),
        "png-named-jpeg": encoded(rgb, "PNG"),
        "exif-rotated": encoded(rotated, "JPEG", exif=exif),
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "too-small": encoded(Image.new("RGB", (16, 12)), "JPEG"),
    }


def make_image_folder(root: Path, samples: int, seed: int) -> int:
    """Write `samples` images in 1,000 class folders (ImageNet's names); ~1 in 4,000 is awkward."""
    marker = root.with_name(root.name + ".complete")  # beside the folder: a file inside would be an input
    if marker.exists():
        return samples
    pool, awkward = tiny_jpegs(seed), list(awkward_samples().values())
    rng = random.Random(seed)
    start = time.perf_counter()
    for index in range(samples):
        cls = index % IMAGENET_CLASSES
        folder = root / wnid(cls)
        if index < IMAGENET_CLASSES:
            folder.mkdir(parents=True, exist_ok=True)
        awkward_one = index % AWKWARD_EVERY == 17
        data = awkward[index // AWKWARD_EVERY % len(awkward)] if awkward_one else pool[rng.randrange(len(pool))]
        (folder / f"{wnid(cls)}_{index}.JPEG").write_bytes(data)
        if index and index % 100_000 == 0:
            rate = index / (time.perf_counter() - start)
            print(f"  images: {index:,}/{samples:,}, ETA {(samples - index) / rate:.0f} s", flush=True)
    marker.write_text(str(samples))
    return samples


def make_plain_set(images: Path, out: Path) -> int:
    """The same images as a plain WebDataset set (jpg + cls members, no index files, no manifest)."""
    if (out / ".complete").exists():
        return len(list(out.glob("*.tar")))
    out.mkdir(parents=True, exist_ok=True)
    classes = sorted(p.name for p in images.iterdir() if p.is_dir())
    files = [(path, label) for label, name in enumerate(classes) for path in sorted((images / name).iterdir())]
    random.Random(1).shuffle(files)
    tars = 0
    for first in range(0, len(files), SAMPLES_PER_TAR):
        with tarfile.open(out / f"train-{tars:06d}.tar", "w") as tar:
            for path, label in files[first:first + SAMPLES_PER_TAR]:
                for name, data in ((f"{path.stem}.jpg", path.read_bytes()), (f"{path.stem}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        tars += 1
    (out / ".complete").write_text(str(tars))
    return tars


def probe(job: str, samples: int, args: list[str], workdir: Path, env: dict | None = None) -> Measured:
    """Run `relicv2 ARGS` under the probe; wall, CPU (children included) and peak RSS from wait4."""
    workdir = workdir / "work"  # the cwd: not the set's folder, whose `shards/` would shadow the package
    workdir.mkdir(exist_ok=True)
    stats = workdir / f".probe-{job}.json"
    log = (workdir / f"{job}.log").open("w")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", PROBE, str(stats), *args], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})}, cwd=workdir)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    log.close()
    result = json.loads(stats.read_text()) if stats.exists() else {"opened": 0, "rchar": 0, "code": -1}
    return Measured(job, samples, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, result["opened"],
                    result["rchar"] / 2**20, os.waitstatus_to_exitcode(status) or result["code"])


def paper_metrics(path: Path, steps: int = 312_000, log_every: int = 10) -> None:
    """A metrics.jsonl as long as the paper run's (312,000 steps at the default log interval)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for step in range(log_every, steps + 1, log_every):
            record = {"step": step, "loss": 5.0 - step / steps, "lr": 0.3, "ema": 0.996, "images_per_s": 1000.0,
                      "data_wait_s": 0.01}
            if step % 12_510 == 0:
                record["knn_top1"] = step / steps * 0.7
            handle.write(json.dumps(record) + "\n")


def run(out: Path, samples: int, jobs: list[str]) -> list[Measured]:
    out.mkdir(parents=True, exist_ok=True)
    images, shards, plain = out / "images", out / "shards", out / "plain"
    print(f"making {samples:,} images in {images} (reused when present)", flush=True)
    make_image_folder(images, samples, seed=0)
    rows = []

    def record(measured: Measured) -> None:
        rows.append(measured)
        print(measured.row(), flush=True)

    if "build" in jobs:
        record(probe("shards build", samples, ["shards", "build", str(images), str(shards), "--overwrite",
                                               "--max-count", str(SAMPLES_PER_TAR), "--no-progress"], out))
    if "index" in jobs:
        make_plain_set(images, plain)
        record(probe("shards index (plain set)", samples, ["shards", "index", str(plain), "--index-cache",
                                                           str(out / "index-cache")], out))
    if "verify" in jobs:
        record(probe("shards verify --no-decode", samples, ["shards", "verify", str(shards), "--no-decode",
                                                            "--no-progress"], out))
    if "subset" in jobs:
        record(probe("shards subset 10%", samples, ["shards", "subset", str(shards), "--fraction", "0.1", "--out",
                                                    str(out / "subset-10pct.txt")], out))
    if "pretrain-start" in jobs:
        record(probe("pretrain to its first step", samples, [
            "pretrain", "--config", "demo-cpu",
            "--set", f"data.train_shards={shards}", "--set", f"run.output_dir={out / 'run'}",
            "--set", "run.max_steps=1", "--set", "views.large_size=32", "--set", "views.small_size=16",
            "--set", "knn.train_shards=", "--set", "knn.val_shards=", "--set", "run.progress_bar=false"], out))
    if "report" in jobs:
        paper_metrics(out / "paper-run" / "metrics.jsonl")
        record(probe("report (312,000-step metrics)", 312_000, ["report", "--out", str(out / "report" / "report.html"),
                                                               "--run", str(out / "paper-run")], out))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the set (made once, reused) and logs")
    parser.add_argument("--samples", type=int, default=IMAGENET_TRAIN)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK:,} samples")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {', '.join(JOBS)}")
    args = parser.parse_args()
    samples = QUICK if args.quick else args.samples
    jobs = [job.strip() for job in args.jobs.split(",") if job.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"unknown job(s) {unknown}; choose from {', '.join(JOBS)}")
    print(HEADER)
    rows = run(args.out, samples, jobs)
    if any(row.code for row in rows):
        print("some jobs exited non-zero: their logs are in", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()

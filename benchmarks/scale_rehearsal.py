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

Jobs that are not one command run a stage of this script under the same probe (`stage NAME ...`):
build-masks with the benchmark's stand-in forward for chosen ranks of 64 (and resumed on one rank after
half the units), the kNN bank search and the fast linear head on random features of the R50's dimension
(the features themselves need the network on a GPU), and `eval linear --config fast`'s steps with a
stand-in encoder.

`--quick` is 100,000 samples. Run at 10 k, 100 k and 1.28 M to see the curve (each size its own DIR).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
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
JOBS = ("build", "index", "verify", "subset", "pretrain-start", "report", "build-rank0", "masks", "masks-resume",
        "knn-bank", "knn", "linear", "linear-bank", "resume")
WORLD = 64  # the simulated world size of the per-rank jobs
R50_DIM = 2048  # the R50's feature dimension: the kNN bank's width
MASK_SIZE = 32  # the stand-in saliency model's input size
REPO = Path(__file__).resolve().parent.parent  # on the jobs' path: this checkout's code, not an installed one

# Runs a relicv2 command in this process with an audit hook that counts the files it opens, then
# writes what /proc says it read; the parent takes CPU and peak RSS from wait4 (workers included).
PROBE = r"""
import json, sys
opened = [0]
def hook(event, args):
    if event == "open":
        opened[0] += 1
sys.addaudithook(hook)
code, stats = 0, sys.argv[1]
try:
    if sys.argv[2] == "stage":  # a stage of the rehearsal script itself: python SCRIPT NAME ARGS
        import runpy
        sys.argv = [sys.argv[3], "stage", *sys.argv[4:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from relicv2.cli.main import cli
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
    with open(stats, "w") as handle:
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


def job_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a job: this one, this checkout first on the path, and `extra`."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def probe(job: str, samples: int, args: list[str], workdir: Path, env: dict | None = None) -> Measured:
    """Run `relicv2 ARGS` under the probe; wall, CPU (children included) and peak RSS from wait4."""
    workdir = workdir / "work"  # the cwd: not the set's folder, whose `shards/` would shadow the package
    workdir.mkdir(exist_ok=True)
    stats = workdir / f".probe-{job}.json"
    log = (workdir / f"{job}.log").open("w")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", PROBE, str(stats), *args], stdout=log, stderr=subprocess.STDOUT,
                               env=job_env(env), cwd=workdir)
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


def since_process_start() -> float:
    """Seconds since this process started (imports included), from /proc."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def stage_masks(shards: Path, out: Path, ranks: list[int], workers: int | None, merge_timeout: float,
                world: int = WORLD) -> None:
    """`saliency build-masks` for each of `ranks` of `world` in turn, the forward replaced by
    bench_build_masks.py's stand-in (no network: what is left is the job's own work). Prints when
    each rank's first batch reaches the forward: its first unit of work."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_build_masks import StandInForward

    class FirstBatchTimed(StandInForward):
        def __init__(self, rank: int) -> None:
            super().__init__(MASK_SIZE, 0.0)
            self.rank, self.started, self.first = rank, time.perf_counter(), True

        def launch(self, squares, out):
            if self.first:
                self.first = False
                print(f"rank {self.rank}: first batch at {time.perf_counter() - self.started:.1f} s into the job, "
                      f"{since_process_start():.1f} s after the process started", flush=True)
            return super().launch(squares, out)

    from relicv2.jobs.ranks import Ranks
    from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks
    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model

    model = out.with_name("saliency-model.pt")  # beside --out: the job refuses files it did not write
    if not model.exists():
        torch.manual_seed(0)
        save_model(model, SaliencyNet(18).eval(), input_size=MASK_SIZE, preset="rehearsal",
                   backbone="random initialisation", config={}, report={})
    config = BuildMasksConfig(model=model, shards=shards, out=out, workers=workers, device="cpu", progress=False,
                              merge_timeout_s=merge_timeout)
    for rank in ranks:
        start = time.perf_counter()
        summary = build_masks(config, Ranks(rank, world, 0), predictor=FirstBatchTimed(rank))
        done = f"{summary['written']:,} masked in all, merged" if summary else "its units done"
        print(f"rank {rank} of {world}: {time.perf_counter() - start:.1f} s, {done}", flush=True)


def stage_knn_bank(bank_size: int, queries: int, dim: int) -> None:
    """`eval knn`'s search over a bank of `bank_size` random features of width `dim` (what
    extract_features hands it), for `queries` queries in the search's own chunks; prints the figures."""
    import resource

    import torch

    from relicv2.pretrain.knn.classify import knn_predict

    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    bank = torch.empty(bank_size, dim)
    for first in range(0, bank_size, 65_536):  # filled in slices: no second bank-sized temporary
        bank[first:first + 65_536] = torch.randn(min(65_536, bank_size - first), dim, generator=generator)
    labels = torch.randint(0, IMAGENET_CLASSES, (bank_size,), generator=generator)
    made = time.perf_counter() - start
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    knn_predict(bank, labels, torch.randn(queries, dim, generator=generator), num_classes=IMAGENET_CLASSES)
    search = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"bank {bank_size:,} x {dim} float32: {bank.numel() * 4 / 2**20:,.0f} MiB, made in {made:.1f} s, "
          f"RSS {held:,.0f} MiB; search of {queries:,} queries: {search:.1f} s "
          f"({search / queries * 1e3:.1f} ms a query; 50,000 queries: {search / queries * 50_000 / 60:.0f} min), "
          f"peak RSS {peak:,.0f} MiB (+{peak - held:,.0f} MiB for the search)", flush=True)


class StandInEncoder:
    """An encoder's stand-in for the linear probe: `dim` features an image (the R50's 2,048) from its pooled
    pixels, no network; what is left is the job's own work (decoding, batching, the bank, the cache, the head)."""

    def __new__(cls, dim: int):
        import torch
        from torch import nn

        class Encoder(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.mean(dim=(2, 3)).repeat(1, dim // 3 + 1)[:, :dim]

        return Encoder()


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def head_epoch(train, val, config) -> None:
    """One epoch of the fast protocol's head on `train`, scored on `val`; prints it and the preset's whole."""
    import dataclasses

    from relicv2.evaluation.linear import train_linear_on_features

    start = time.perf_counter()
    result = train_linear_on_features(train, val, dataclasses.replace(config, epochs=1), num_classes=IMAGENET_CLASSES)
    epoch = time.perf_counter() - start
    print(f"head: 1 epoch of {len(train):,} in {epoch:.1f} s (the preset's {config.epochs} epochs: "
          f"{epoch * config.epochs / 60:.0f} min), top-1 {result.top1:.4f}, peak RSS {peak_rss_mib():,.0f} MiB",
          flush=True)


def stage_linear(shards: Path, val: Path, out: Path, dim: int) -> None:
    """`eval linear --config fast`'s steps on a shard set with the encoder's stand-in (16 px views): the
    features of both sets extracted and cached, the cache read back, one epoch of the head."""
    from relicv2.evaluation.features import FeatureSpec, cached_features
    from relicv2.evaluation.job import load_linear_config
    from relicv2.shards import resolve_shard_set

    config = load_linear_config("fast", ["crop_size=16", "resize_size=16"])
    spec = FeatureSpec(crop_size=config.crop_size, resize_size=config.resize_size, batch_size=config.feature_batch)
    cache, encoder = out / "features", StandInEncoder(dim)
    if cache.exists():
        shutil.rmtree(cache)  # this script's own output: every run extracts anew
    start = time.perf_counter()
    sets = [resolve_shard_set(source) for source in (shards, val)]
    sizes = [len(cached_features(encoder, source, spec, cache_dir=cache)) for source in sets]
    extracted = time.perf_counter() - start
    print(f"features of {sizes[0]:,} + {sizes[1]:,} images ({dim} wide) extracted and cached in {extracted:.1f} s "
          f"({extracted / sum(sizes) * 1e3:.2f} ms an image), peak RSS {peak_rss_mib():,.0f} MiB", flush=True)
    start = time.perf_counter()
    train, val_set = (cached_features(encoder, source, spec, cache_dir=cache) for source in sets)
    print(f"cache read back in {time.perf_counter() - start:.1f} s", flush=True)
    head_epoch(train, val_set, config)


def stage_linear_bank(bank_size: int, dim: int, out: Path) -> None:
    """The fast head on a bank of `bank_size` random features of width `dim` (what `eval linear --config
    fast` holds for ImageNet): the bank written and read back as the feature cache holds it, one epoch."""
    import torch

    from relicv2.evaluation.features import FeatureSet
    from relicv2.evaluation.job import load_linear_config

    generator = torch.Generator().manual_seed(0)

    def features(rows: int) -> FeatureSet:
        bank = torch.empty(rows, dim)
        for first in range(0, rows, 65_536):  # filled in slices: no second bank-sized temporary
            bank[first:first + 65_536] = torch.randn(min(65_536, rows - first), dim, generator=generator)
        return FeatureSet(bank, torch.randint(0, IMAGENET_CLASSES, (rows,), generator=generator))

    start = time.perf_counter()
    train, val = features(bank_size), features(max(IMAGENET_CLASSES, bank_size // 25))
    print(f"bank {bank_size:,} x {dim}: {train.features.numel() * 4 / 2**20:,.0f} MiB, made in "
          f"{time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mib():,.0f} MiB", flush=True)
    path = out / "linear-bank.pt"
    start = time.perf_counter()
    torch.save({"features": train.features, "labels": train.labels}, path)
    saved = time.perf_counter() - start
    del train  # read back in its place, as a rerun reads its cache
    start = time.perf_counter()
    payload = torch.load(path, map_location="cpu", weights_only=True)
    print(f"cache {path.stat().st_size / 2**30:.2f} GiB: written in {saved:.1f} s, read in "
          f"{time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mib():,.0f} MiB", flush=True)
    path.unlink()
    head_epoch(FeatureSet(payload["features"], payload["labels"]), val, load_linear_config("fast"))


def stage(argv: list[str]) -> None:
    """`python scale_rehearsal.py stage NAME ARGS`: a job that is not one relicv2 command."""
    name, args = argv[0], argv[1:]
    if name == "masks":
        shards, out, ranks, workers, merge_timeout, world = args
        stage_masks(Path(shards), Path(out), [int(r) for r in ranks.split(",")],
                    None if workers == "default" else int(workers), float(merge_timeout), int(world))
    elif name == "torchrun":  # ranks as processes on this box: relicv2 ARGS under torchrun, gloo on the CPU
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args[0]}",
                               "-m", "relicv2", *args[1:]], env=job_env())
        raise SystemExit(done.returncode)
    elif name == "knn-bank":
        stage_knn_bank(*(int(a) for a in args))
    elif name == "linear":
        stage_linear(Path(args[0]), Path(args[1]), Path(args[2]), int(args[3]))
    elif name == "linear-bank":
        stage_linear_bank(int(args[0]), int(args[1]), Path(args[2]))
    else:
        raise SystemExit(f"unknown stage {name}")


PRETRAIN_SETS = ("--set", "views.large_size=32", "--set", "views.small_size=16", "--set", "knn.train_shards=",
                 "--set", "knn.val_shards=", "--set", "run.progress_bar=false")


def rank_env(rank: int) -> dict[str, str]:
    """torchrun's variables for rank `rank` of WORLD, the rank alone on its node."""
    return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def val_set(out: Path, samples: int) -> Path:
    """A validation set for the evaluations (made once): 1 sample in 25 (ImageNet's val), the same classes."""
    images, val = out / "val-images", out / "val-shards"
    make_image_folder(images, max(IMAGENET_CLASSES, samples // 25), seed=1)
    if not (val / "info.json").exists():
        subprocess.run([sys.executable, "-m", "relicv2", "shards", "build", str(images), str(val), "--no-progress"],
                       check=True, env=job_env(), stdout=subprocess.DEVNULL, cwd=out / "work")
    return val


def run(out: Path, samples: int, jobs: list[str]) -> list[Measured]:
    (out / "work").mkdir(parents=True, exist_ok=True)
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
            "pretrain", "--config", "demo-cpu", "--set", f"data.train_shards={shards}",
            "--set", f"run.output_dir={out / 'run'}", "--set", "run.max_steps=1", *PRETRAIN_SETS], out))
    if "build-rank0" in jobs:  # rank 0 of 64 alone: its share, then the merge finds the other ranks missing
        record(probe(f"shards build, rank 0 of {WORLD}", samples, [
            "shards", "build", str(images), str(out / "shards-rank0"), "--overwrite", "--max-count",
            str(SAMPLES_PER_TAR), "--no-progress", "--merge-timeout", "0"], out, rank_env(0)))
    if "masks" in jobs:
        masked = out / "masked"
        if masked.exists():
            shutil.rmtree(masked)  # this script's own output: every run masks anew
        script = str(Path(__file__).resolve())

        def masks(label: str, ranks: str, workers: str = "default", env: dict | None = None) -> None:
            record(probe(label, samples, ["stage", script, "masks", str(shards), str(masked), ranks, workers, "0",
                                          str(WORLD)], out, env))

        masks(f"build-masks rank 1 of {WORLD} (stand-in forward)", "1", env=rank_env(1))
        masks(f"build-masks rank {WORLD - 1} of {WORLD}", str(WORLD - 1), env=rank_env(WORLD - 1))
        masks(f"build-masks ranks 2-{WORLD - 2} in one process, no workers", ",".join(map(str, range(2, WORLD - 1))),
              "0")
        masks(f"build-masks rank 0 of {WORLD}: its units + merge of {WORLD} ranks", "0", env=rank_env(0))
        masks(f"build-masks rank 0 of {WORLD} again: all done, merge only", "0", env=rank_env(0))
    if "masks-resume" in jobs:  # half the units done by ranks of 64, then the job again on one rank
        masked = out / "masked-resume"
        if masked.exists():
            shutil.rmtree(masked)  # this script's own output
        script = str(Path(__file__).resolve())
        half = ",".join(map(str, range(1, WORLD // 2 + 1)))
        subprocess.run([sys.executable, script, "stage", "masks", str(shards), str(masked), half, "0", "0", str(WORLD)],
                       check=True, env=job_env(), cwd=out / "work", stdout=subprocess.DEVNULL)
        record(probe(f"build-masks resumed on 1 rank, ranks 1-{WORLD // 2} of {WORLD} done", samples, [
            "stage", script, "masks", str(shards), str(masked), "0", "default", "0", "1"], out))
    if "knn-bank" in jobs:
        record(probe(f"eval knn search: {samples:,} x {R50_DIM} bank, 256 queries", samples, [
            "stage", str(Path(__file__).resolve()), "knn-bank", str(samples), "256", str(R50_DIM)], out))
    if "knn" in jobs:
        val = val_set(out, samples)
        record(probe("eval knn --random-init 18, 16 px crops", samples, [
            "eval", "knn", "--random-init", "18", "--train", str(shards), "--val", str(val), "--crop-size", "16",
            "--resize-size", "16", "--device", "cpu", "--json", str(out / "knn.json")], out))
    if "linear" in jobs:
        record(probe(f"eval linear --config fast, stand-in encoder ({R50_DIM} features), 1 epoch", samples, [
            "stage", str(Path(__file__).resolve()), "linear", str(shards), str(val_set(out, samples)), str(out),
            str(R50_DIM)], out))
    if "linear-bank" in jobs:
        record(probe(f"eval linear --config fast head: {samples:,} x {R50_DIM} bank, 1 epoch", samples, [
            "stage", str(Path(__file__).resolve()), "linear-bank", str(samples), str(R50_DIM), str(out)], out))
    if "resume" in jobs:
        resumed = out / "resume-run"
        if resumed.exists():
            shutil.rmtree(resumed)  # this script's own output
        common = ["pretrain", "--config", "demo-cpu", "--set", f"data.train_shards={shards}",
                  "--set", f"run.output_dir={resumed}", "--set", "run.checkpoint_every=2", *PRETRAIN_SETS]
        record(probe("pretrain 4 steps, a checkpoint every 2", samples, [*common, "--set", "run.max_steps=4"], out))
        record(probe("pretrain resumed at step 4, to its first step", samples,
                     [*common, "--set", "run.max_steps=5"], out))
        record(probe("pretrain resumed at step 5 on 2 gloo ranks, to its first step", samples, [
            "stage", str(Path(__file__).resolve()), "torchrun", "2", *common, "--set", "run.max_steps=6"], out))
    if "report" in jobs:
        paper_metrics(out / "paper-run" / "metrics.jsonl")
        record(probe("report (312,000-step metrics)", 312_000, ["report", "--out", str(out / "report" / "report.html"),
                                                               "--run", str(out / "paper-run")], out))
    return rows


def main() -> None:
    if sys.argv[1:2] == ["stage"]:
        stage(sys.argv[2:])
        return
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

"""Images/s of the view pipeline against a plain DALI pipeline and the PIL/torchvision reference.

Builds a masked shard set from `../shared/data/msra-unlabeled` in a temporary folder (the photos'
JPEG bytes as they are, plus a synthetic soft elliptic mask per image so mask decoding, cropping
and blending are part of the work), then, in one run on the same images:
- the project's pipeline (`ViewLoader`, DALI backend: DALI geometry, colour steps as batched torch
  operations), with each step on the rows that drew it (`torch-colour`, `colour_kernels=select`) and with
  every row through compiled kernels (`torch-fused`, `colour_kernels=fused`), each with the operator count of
  its GPU graph (what the DALI executor runs per batch);
- the PIL/torchvision reference (`ViewLoader`, reference backend: a torch DataLoader, one worker per thread);
- `../shared/tools/dali-views-floor`: a plain DALI pipeline with the same view geometry, colour jitter
  and blur but no masks (what DALI itself reaches here), bare and with colour;
and prints each as images/s and as ratios to the reference and to the floor. Timed batches run
across epoch ends (the loader is iterated epoch after epoch), so `--batches` may exceed one pass.
`--profile N` then runs N more batches of the first project pipeline under torch.profiler and prints
where a batch's time goes: the loader's stages (DALI's run, its outputs, the torch colour stage) in
CPU and device ms per batch, and the operators with the most time (`--trace FILE` keeps the trace).

    python benchmarks/bench_views.py --batch 16 --threads 2                       # CPU box
    python benchmarks/bench_views.py --device cuda --batch 256 --threads 8        # the GPU figure (one H100)
    python benchmarks/bench_views.py --device cuda --batch 256 --threads 8 --pipelines torch-colour --profile 4
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs without the project installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from PIL import Image  # noqa: E402

from relicv2.pretrain.views.config import ViewConfig, ready_batches  # noqa: E402
from relicv2.pretrain.views.dali import PROFILE_RANGES  # noqa: E402
from relicv2.pretrain.views.loader import ViewLoader  # noqa: E402
from relicv2.pretrain.views.reference import dataloader_workers  # noqa: E402
from relicv2.shards import ShardSample, write_shard_set  # noqa: E402
from relicv2.shards.images import displayed_size  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The team's shared folder beside the checkout (or inside it, where a copy of the tree carries it).
SHARED = next((p for p in (REPO.parent / "shared", REPO / "shared") if p.is_dir()), REPO.parent / "shared")
DATA = SHARED / "data" / "msra-unlabeled"
FLOOR = SHARED / "tools" / "dali-views-floor"
FLOOR_LINE = re.compile(r"colour\+blur=(True|False)\): (\d+) images/s")
# The project's pipelines: name -> its view settings over the common ones.
STAGES = {
    "torch-colour": {"colour_kernels": "select"},  # each step on the rows that drew it
    "torch-fused": {"colour_kernels": "fused"},  # every row through compiled kernels
}


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


def source_images(source: Path, limit: int) -> list[Path]:
    return sorted(source.glob("*.jpg"))[:limit]


def build_masked_shards(images: list[Path], out: Path) -> int:
    rng = np.random.default_rng(0)
    samples = []
    for path in images:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            width, height = displayed_size(im)  # masks are at the displayed size (EXIF applied), as DALI decodes
        samples.append(ShardSample(path.stem, {"jpg": data, "mask.png": soft_ellipse(width, height, rng)}, None,
                                   {"width": width, "height": height}))
    write_shard_set(samples, out, prefix="masked", max_count=250)
    return len(samples)


def endless(loader: ViewLoader) -> Iterator[dict]:
    """Batches epoch after epoch (a ViewLoader iteration ends with its epoch)."""
    while True:
        yield from loader


def window(views: ViewConfig, device: str, args) -> tuple[int, int]:
    """(warm-up batches, timed batches) for a pipeline, so that batches made before the clock starts do not
    count as made in the timed window.

    The project's pipelines make up to DALI's prefetch queue plus the loader's ready batches ahead, all at
    once at the start: the warm-up takes at least that many. The reference's DataLoader workers start
    together and each makes a whole batch, so with a consumer faster than they are its batches arrive in
    rounds of one per worker (a round of 8 all at once, then nothing for a batch's time): both counts are
    whole rounds, or a short window (6 batches after 2, with 8 workers) times batches that were already made.
    """
    if views.backend == "reference":
        workers = max(1, dataloader_workers(views))
        return workers * -(-max(1, args.warmup) // workers), workers * -(-args.batches // workers)
    return max(args.warmup, views.prefetch + ready_batches(views, device)), args.batches


def timed(shards: Path, views: ViewConfig, device: str, args) -> tuple[float, float, float, int, str]:
    """(images/s wall clock, CPU ms per image of this process, of this thread alone, images timed, the
    window in words)."""
    loader = ViewLoader(shards, args.batch, views, device=device, seed=1)
    batches = endless(loader)
    warmup, count = window(views, device, args)
    for _ in range(warmup):
        next(batches)
    start, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    done = 0
    for _ in range(count):
        batch = next(batches)
        done += len(batch["keys"])
    if device != "cpu":
        torch.cuda.synchronize()  # the last views are ready
    wall, cpu, own = time.perf_counter() - start, time.process_time() - cpu, time.thread_time() - own
    return done / wall, 1000 * cpu / done, 1000 * own / done, done, f"{count} batches after {warmup}"


def profiled(shards: Path, views: ViewConfig, device: str, args) -> None:
    """Print where a batch's time goes, from torch.profiler over `args.profile` batches after warm-up.

    Batches are made on demand (`ready_batches=0`), so every stage runs in this thread between two
    timestamps and the stages add up to the wall time per batch.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    views = ViewConfig(**{**views.__dict__, "ready_batches": 0})
    loader = ViewLoader(shards, args.batch, views, device=device, seed=1)
    batches = endless(loader)
    for _ in range(window(views, device, args)[0]):
        next(batches)
    cuda = device != "cpu"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as trace:
        start = time.perf_counter()  # the profiler's start and its processing at the end left out
        for _ in range(args.profile):
            next(batches)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.profile
    # The ranges' CPU events: on a GPU each range is also a GPU annotation, whose span (idle gaps
    # included) key_averages() would add to the kernels' device time.
    stages = [e for e in trace.events() if e.name in PROFILE_RANGES and e.device_type == DeviceType.CPU]
    print(f"profile: {args.profile} batches of {args.batch} made on demand, {1000 * wall:.1f} ms wall a batch "
          "(profiler overhead included); per batch:")
    for name in PROFILE_RANGES:
        cpu_us = sum(e.cpu_time_total for e in stages if e.name == name)
        device_us = sum(e.device_time_total for e in stages if e.name == name)
        print(f"  {name:22s} CPU {cpu_us / 1000 / args.profile:8.1f} ms"
              + (f", device (its kernels) {device_us / 1000 / args.profile:8.1f} ms" if cuda else ""))
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(trace.key_averages().table(sort_by=sort, row_limit=args.profile_rows))
    if args.trace:
        trace.export_chrome_trace(str(args.trace))
        print(f"trace written to {args.trace} (chrome://tracing or ui.perfetto.dev)")


def gpu_graph_size(shards: Path, views: ViewConfig, batch: int) -> str:
    """Operators of the view pipeline's GPU graph by device, traced without building (no GPU needed)."""
    from relicv2.pretrain.views.dali_pipeline import _views_pipeline
    from relicv2.shards.sample_set import load_sample_set

    pipe = _views_pipeline(load_sample_set(shards), views, True, 0, 1, 0, batch_size=batch, num_threads=1, device_id=0,
                           seed=1)
    pipe._build_graph()  # private: DALI has no public listing of a pipeline's operators
    devices = Counter(op._op.device for op in pipe._ops)
    return f"{sum(devices.values())} operators ({', '.join(f'{n} {d}' for d, n in sorted(devices.items()))})"


def floor_rates(image_dir: Path, args) -> dict[str, float]:
    """{"floor-bare": images/s, "floor-colour": images/s} from the DALI floor tool, same images."""
    if not args.floor.is_file():
        print(f"{args.floor} not found: floor not measured (pass --floor)")
        return {}
    command = [sys.executable, str(args.floor), "--data", str(image_dir), "--device", args.device, "--batch",
               str(args.batch), "--threads", str(args.threads), "--iterations", str(args.batches)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    rates = {("floor-colour" if colour == "True" else "floor-bare"): float(rate)
             for colour, rate in FLOOR_LINE.findall(result.stdout)}
    if result.returncode != 0 or len(rates) != 2:
        print(f"the floor tool failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (DALI CPU operators) or cuda (DALI mixed)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads and reference DataLoader workers")
    parser.add_argument("--batches", type=int, default=6, help="timed batches per pipeline (may span epochs)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--large-size", type=int, default=224)
    parser.add_argument("--small-size", type=int, default=96)
    parser.add_argument("--pipelines", default=",".join([*STAGES, "reference", "floor"]),
                        help=f"comma-separated subset of {', '.join(STAGES)}, reference, floor")
    parser.add_argument("--data", type=Path, default=DATA, help="folder of JPEG photos")
    parser.add_argument("--floor", type=Path, default=FLOOR, help="the dali-views-floor script")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N batches of the first project pipeline (stages and top operators)")
    parser.add_argument("--profile-rows", type=int, default=15, help="operators listed by --profile")
    parser.add_argument("--trace", type=Path, help="with --profile: write the Chrome trace to this file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a views setting for every pipeline (YAML value), e.g. --set hw_decoder_load=0.9")
    args = parser.parse_args()
    if not args.data.is_dir():
        raise SystemExit(f"{args.data} not found; pass --data with a folder of JPEG photos")
    images = source_images(args.data, args.images)
    if len(images) < args.batch:
        raise SystemExit(f"{args.data} has {len(images)} JPEG files, fewer than one batch of {args.batch}")
    # A whole number of batches per epoch: the reader's padded tail batch, run and dropped at every
    # epoch end, would otherwise count as time without images on a small set.
    images = images[: len(images) // args.batch * args.batch]
    wanted = args.pipelines.split(",")
    settings = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in ViewConfig.__dataclass_fields__:
            raise SystemExit(f"--set {item}: expected KEY=VALUE with KEY a ViewConfig field")
        settings[key] = yaml.safe_load(value)
    base = ViewConfig(**{"large_size": args.large_size, "small_size": args.small_size, "num_threads": args.threads,
                         **settings})
    with tempfile.TemporaryDirectory(prefix="bench-views-") as tmp:
        start = time.perf_counter()
        shards, floor_dir = Path(tmp) / "shards", Path(tmp) / "jpegs"
        count = build_masked_shards(images, shards)
        floor_dir.mkdir()
        for path in images:  # the floor tool reads a folder: the same files, linked
            (floor_dir / path.name).symlink_to(path.resolve())
        print(f"built {count} masked samples in {time.perf_counter() - start:.1f} s")
        print(f"views: 4 x {args.large_size} + 2 x {args.small_size}, batch {args.batch}, {args.threads} threads/workers, "
              f"{args.batches} timed batches after {args.warmup} (more where batches are made ahead), "
              f"device {args.device}"
              + (f", settings {settings}" if settings else ""))
        rates: dict[str, float] = {}
        cpu_ms: dict[str, float] = {}
        for name in (*STAGES, "reference"):
            if name not in wanted:
                continue
            if name == "reference":
                views, device = ViewConfig(**{**base.__dict__, "backend": "reference"}), "cpu"
            else:
                views, device = ViewConfig(**{**base.__dict__, **STAGES[name]}), args.device
                print(f"{name:12s} GPU graph: {gpu_graph_size(shards, views, args.batch)}", flush=True)
            rates[name], ms, _, done, span = timed(shards, views, device, args)
            if name == "reference":
                # DataLoader workers are other processes: the CPU cost per image is timed in-process, where
                # all of the reference's work runs in this thread. The process's CPU time also counts any
                # other thread still running, so the ratios use this thread's, the smaller, and both are
                # printed.
                torch.set_num_threads(1)
                # One batch after one: at ~0.2 s an image on a GPU host, the whole window would take minutes.
                short = argparse.Namespace(**{**vars(args), "batches": 1, "warmup": 1})
                _, whole, ms, _, _ = timed(shards, ViewConfig(**{**views.__dict__, "num_threads": 1}), device, short)
                print(f"reference in-process: {whole:.1f} CPU ms/image for the process, {ms:.1f} for its own thread"
                      + (" (other threads of this process used CPU meanwhile)" if whole > 1.2 * ms else ""))
            cpu_ms[name] = ms
            print(f"{name:12s} ({device}): {rates[name]:8.1f} images/s, {ms:6.1f} CPU ms/image ({done} images, "
                  f"{span})", flush=True)
        project = [name for name in STAGES if name in wanted]
        if args.profile and project:
            profiled(shards, ViewConfig(**{**base.__dict__, **STAGES[project[0]]}), args.device, args)
        if "floor" in wanted:
            rates.update(floor_rates(floor_dir, args))
            for name in ("floor-bare", "floor-colour"):
                if name in rates:
                    print(f"{name:12s} ({args.device}): {rates[name]:8.1f} images/s", flush=True)
    print("ratios (same run):")
    for name in STAGES:
        if name not in rates:
            continue
        parts = [f"{rates[name] / rates[other]:.2f}x {other}" for other in ("reference", "floor-colour", "floor-bare")
                 if other in rates]
        if "reference" in cpu_ms:
            parts.append(f"{cpu_ms['reference'] / cpu_ms[name]:.2f}x reference by CPU time per image")
        print(f"  {name}: " + (", ".join(parts) or "nothing else measured in this run"))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: wall figures vary)")


if __name__ == "__main__":
    main()

"""The torch colour stage alone: each view coloured on its own, the views of one size as one batch, and fused.

Random 8-bit views (4 x 224 + 2 x 96 by default) with draws at the paper's probabilities (jitter,
grayscale, each view's blur and solarize, saliency masking at p_m) go through `colour_views` three
times, in the same run and on the same draws: each view alone (`stack=False`, the default on the CPU),
the views of one size as one batch (`stack=True`, the default on a GPU), and those batches with every
row through every step (`fused=True`: `views.colour_kernels`, compiled on a GPU). Printed for each:
the operators dispatched a batch and those among them that compute (each at least one kernel launch
on a GPU, where the stage is launch-bound; the others are views; 0 for the fused row on a GPU, whose
compiled kernels are not counted), the CPU ms the calling thread spends a batch, the wall ms a batch
(the device synchronised after each batch), and the ratios. The three ways must agree first (TF32 off:
cuDNN may run one way's blur in TF32 and not another's).

    python benchmarks/bench_colour.py --batch 32                   # CPU box
    python benchmarks/bench_colour.py --device cuda --batch 256    # one H100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs without the project installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from relicv2.pretrain.views.colour import Background, ColourDraws, colour_views  # noqa: E402
from relicv2.pretrain.views.config import JITTER_ORDERS, ViewConfig, ViewSpec, view_specs  # noqa: E402


class OperatorCount(TorchDispatchMode):
    """Counts the operators that reach a backend (after autograd and composite decompositions): all of
    them, and those that compute (not views: a slice or a reshape costs dispatch time, no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.computing += not func.is_view
        return func(*args, **(kwargs or {}))


def paper_draws(spec: ViewSpec, cfg: ViewConfig, batch: int, rng: np.random.Generator) -> ColourDraws:
    """One view's colour draws at the configured probabilities and ranges (what DALI draws)."""
    return ColourDraws(
        jitter=rng.uniform(size=batch) < cfg.jitter_probability,
        order=rng.integers(0, len(JITTER_ORDERS), batch),
        factors=np.stack([rng.uniform(1 - cfg.brightness, 1 + cfg.brightness, batch),
                          rng.uniform(1 - cfg.contrast, 1 + cfg.contrast, batch),
                          rng.uniform(1 - cfg.saturation, 1 + cfg.saturation, batch),
                          rng.uniform(-cfg.hue, cfg.hue, batch)], axis=1),
        grayscale=rng.uniform(size=batch) < cfg.grayscale_probability,
        blur=rng.uniform(size=batch) < spec.blur_probability,
        sigma=rng.uniform(*cfg.blur_sigma, batch),
        solarize=rng.uniform(size=batch) < spec.solarize_probability,
    )


def make_batch(cfg: ViewConfig, batch: int, device: torch.device, rng: np.random.Generator):
    specs = view_specs(cfg)
    views = [torch.from_numpy(rng.integers(0, 256, (batch, s.size, s.size, 3), dtype=np.uint8)).to(device)
             for s in specs]
    draws = [paper_draws(s, cfg, batch, rng) for s in specs]
    grey = np.floor(rng.uniform(*cfg.mask_grey_range, batch) * 255 + 0.5) / 255  # whole 8-bit levels, as the pipeline draws
    backgrounds = {
        j: Background(masked=rng.uniform(size=batch) < s.mask_probability, grey=grey,
                      soft=torch.from_numpy(rng.integers(0, 256, (batch, s.size, s.size, 1), dtype=np.uint8)).to(device))
        for j, s in enumerate(specs) if s.mask_probability > 0
    }
    return specs, views, draws, backgrounds


def each_alone(cfg, specs, views, draws, backgrounds):
    return colour_views(views, draws, specs, cfg, backgrounds, stack=False)


def together(cfg, specs, views, draws, backgrounds):
    return colour_views(views, draws, specs, cfg, backgrounds, stack=True)


def fused(cfg, specs, views, draws, backgrounds):
    return colour_views(views, draws, specs, cfg, backgrounds, stack=True, fused=True)


def measure(run, args, cfg, batches, device, count: bool = True) -> dict[str, float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for batch in batches[: args.warmup]:
        run(cfg, *batch)
    sync()
    counter = OperatorCount()
    if count:  # a dispatch mode around compiled code would trace it again: the fused row counts on a CPU only
        with counter:
            run(cfg, *batches[0])
    cpu_ms, wall_ms = [], []
    for batch in batches[args.warmup :]:
        wall, cpu = time.perf_counter(), time.thread_time()
        run(cfg, *batch)
        cpu_ms.append((time.thread_time() - cpu) * 1e3)
        sync()
        wall_ms.append((time.perf_counter() - wall) * 1e3)
    return {"operators": counter.count, "computing": counter.computing,
            "cpu_ms": statistics.median(cpu_ms), "wall_ms": statistics.median(wall_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=5, help="timed batches (medians are printed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--large-size", type=int, default=224)
    parser.add_argument("--small-size", type=int, default=96)
    parser.add_argument("--mask-probability", type=float, default=0.1, help="p_m (the paper's default)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = ViewConfig(large_size=args.large_size, small_size=args.small_size, mask_probability=args.mask_probability)
    rng = np.random.default_rng(0)
    batches = [make_batch(cfg, args.batch, device, rng) for _ in range(args.warmup + args.batches)]
    first = batches[0]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        alone_views = each_alone(cfg, *first)
        for way in (together, fused):
            for got, want in zip(way(cfg, *first), alone_views, strict=True):
                worst = (got - want).abs().max().item()
                assert worst < 1e-3, f"{way.__name__} and each view alone disagree by {worst:.2g}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"colour stage, {cfg.large_views} x {args.large_size} + {cfg.small_views} x {args.small_size}, "
          f"batch {args.batch}, p_m {args.mask_probability}, {name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads; medians of {args.batches} batches")
    alone = measure(each_alone, args, cfg, batches, device)
    joined = measure(together, args, cfg, batches, device)
    compiled = measure(fused, args, cfg, batches, device, count=device.type == "cpu")
    print(f"{'':<30}{'operators':>10}{'computing':>10}{'CPU ms':>10}{'wall ms':>10}")
    for label, row in (("each view alone", alone), ("views of one size together", joined),
                       ("views of one size, fused", compiled)):
        print(f"{label:<30}{row['operators']:>10}{row['computing']:>10}{row['cpu_ms']:>10.1f}{row['wall_ms']:>10.1f}")
    print(f"together / alone: operators {joined['operators'] / alone['operators']:.2f}x "
          f"(computing {joined['computing'] / alone['computing']:.2f}x), "
          f"CPU ms {joined['cpu_ms'] / alone['cpu_ms']:.2f}x, wall ms {joined['wall_ms'] / alone['wall_ms']:.2f}x")
    print(f"fused / together: CPU ms {compiled['cpu_ms'] / joined['cpu_ms']:.2f}x, "
          f"wall ms {compiled['wall_ms'] / joined['wall_ms']:.2f}x")


if __name__ == "__main__":
    main()

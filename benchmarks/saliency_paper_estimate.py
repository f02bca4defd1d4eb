"""What a `saliency train` preset would take on a GPU machine, from its work counted and rates measured elsewhere.

The preset's work is counted, not timed: the training passes (phase I: methods x iterations x epochs x images;
phase II: fused epochs x images; the CRF refines the predictions of the training pass itself, so there is no other
forward), the FLOPs of one training pass of its network at its input size (`torch.utils.flop_counter` on the meta
device, so nothing is computed), the dense CRFs of phase I and the handcrafted maps. Each is then priced at a rate
measured on the machine (benchmarks/RESULTS.md: the GPU sections and the CPU costs of the CRF and the maps), given
on the command line so the estimate names its source:

    python benchmarks/saliency_paper_estimate.py --config paper \\
        --gpu-tflops 174 --gpu-tflops 267 --crf-cpu-ms 149 --maps-cpu-s 0.46 --cores 16

--gpu-tflops: effective FLOP rates to bracket the network's training (e.g. the compiled R50 step's and the saliency
network's bare forward, each FLOPs an image times images a second). The CRF runs in `--cores` worker processes:
give the run `--set workers=N` for N cores (the preset's default is 2). The CRF of a phase I epoch's predictions runs
while the next epoch trains, so a phase I network takes, over its E epochs, one epoch's training, E - 1 times the
longer of an epoch's training and its CRF, then the last epoch's CRF; the maps come before any training.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.saliency.network.config import SaliencyTrainConfig, load_saliency_config  # noqa: E402
from relicv2.saliency.network.model import SaliencyNet  # noqa: E402
from relicv2.saliency.network.train import plan_units  # noqa: E402


def pass_flops(depth: int, width: int, size: int, train: bool) -> int:
    """FLOPs of one image through the saliency network (forward, or forward and backward) at `size` px."""
    with torch.device("meta"):
        network = SaliencyNet(depth, width)
        images = torch.empty(1, 3, size, size)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = network(images)
        if train:
            logits.sum().backward()
    return counter.get_total_flops()


def work(config: SaliencyTrainConfig) -> tuple[int, int]:
    """(training passes, dense CRFs) of a `saliency train` run of `config`: every epoch's pass over its images,
    and the CRF of each phase I epoch's predictions."""
    units = plan_units(config)
    passes = sum(unit.epochs for unit in units) * config.num_images
    crfs = sum(unit.epochs for unit in units if unit.method is not None) * config.num_images
    return passes, crfs


def hours(config: SaliencyTrainConfig, train_epoch_h: float, crf_epoch_h: float, maps_h: float) -> float:
    """Wall hours of a `saliency train` run of `config` from an epoch's training and CRF and the maps (in hours):
    the maps, each phase I network with its CRFs overlapping its next epochs, then phase II."""
    total = maps_h
    for unit in plan_units(config):
        if unit.method is None:
            total += unit.epochs * train_epoch_h
        else:
            total += train_epoch_h + (unit.epochs - 1) * max(train_epoch_h, crf_epoch_h) + crf_epoch_h
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="paper", help="a `saliency train` preset or YAML file (default: paper)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--gpu-tflops", type=float, action="append", required=True,
                        help="an effective FLOP rate of the GPU in TFLOP/s (give two to bracket the estimate)")
    parser.add_argument("--crf-cpu-ms", type=float, required=True, help="CPU ms of one dense CRF at the input size")
    parser.add_argument("--maps-cpu-s", type=float, required=True, help="CPU s of the four handcrafted maps an image")
    parser.add_argument("--cores", type=int, required=True, help="the machine's CPU cores for the CRF and the maps")
    args = parser.parse_args(argv)
    config = load_saliency_config(args.config, args.overrides)
    passes, crfs = work(config)
    flops = pass_flops(config.depth, config.width, config.input_size, train=True)
    total = passes * flops
    crf_hours = crfs * args.crf_cpu_ms / 1e3 / 3600
    maps_hours = config.num_images * args.maps_cpu_s / 3600
    print(f"preset {config.preset}: ResNet-{config.depth} x{config.width} at {config.input_size} px, "
          f"{config.num_images:,} images, {len(config.methods) * config.iterations} phase I networks x "
          f"{config.epochs} epochs, {config.fuse_epochs} fused epochs")
    print(f"training passes {passes:,} x {flops / 1e9:.0f} GFLOP = {total / 1e15:.3g} PFLOP; "
          f"CRFs {crfs:,} = {crf_hours:.1f} CPU-h; maps {maps_hours * 60:.0f} CPU-min")
    crf_epoch_h = config.num_images * args.crf_cpu_ms / 1e3 / 3600 / args.cores
    for rate in sorted(args.gpu_tflops):
        gpu_hours = total / (rate * 1e12) / 3600
        train_epoch_h = config.num_images * flops / (rate * 1e12) / 3600
        wall = hours(config, train_epoch_h, crf_epoch_h, maps_hours / args.cores)
        print(f"at {rate:g} TFLOP/s: the network {gpu_hours * 60:.1f} min, the CRF and maps on {args.cores} cores "
              f"{(crf_hours + maps_hours) / args.cores * 60:.0f} min: {wall:.1f} h in all (the CRF of an epoch "
              f"beside the next's training)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

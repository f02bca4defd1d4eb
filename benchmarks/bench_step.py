"""Training-step throughput and peak memory of the ReLICv2 trainer (no data loading).

Times `pretrain.trainer.train_step` (forward of L large + S small views through the online
network, target forward, loss, backward, LARS, EMA) on random views already on the device, and
prints images/s (source images, each giving L + S views) and peak memory.

    python benchmarks/bench_step.py                                   # ResNet-50, 4+2 views, CPU, batch 8
    python benchmarks/bench_step.py --device cuda --bf16 --channels-last --batch 256
    python benchmarks/bench_step.py --device cuda --bf16 --channels-last --compile --batch 512 --activation-checkpointing

It also times a bare forward + backward of the encoder alone over the same views (same dtype,
memory format and compile setting, never activation checkpointing), measured in the same run, and
prints the step's time as a ratio of it: what the rest of the step (target, heads, loss, LARS, EMA,
syncs) and, with --activation-checkpointing, the recomputation cost on top of the encoder.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.pretrain.config import derive, load_config  # noqa: E402
from relicv2.pretrain.distributed import describe_environment  # noqa: E402
from relicv2.pretrain.trainer import StepSettings, build_state, train_step, wrap_networks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=8, help="images per step (each gives L + S views)")
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--large-views", type=int, default=4)
    parser.add_argument("--small-views", type=int, default=2)
    parser.add_argument("--large-size", type=int, default=224)
    parser.add_argument("--small-size", type=int, default=96)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the GPU default of the trainer)")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the networks")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute the encoder's activations in backward (model.activation_checkpointing)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its convolution algorithms once per shape (the trainer keeps its heuristic)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = load_config(None, [
        "data.source=synthetic", f"model.depth={args.depth}", f"model.width={args.width}",
        f"views.large_views={args.large_views}", f"views.small_views={args.small_views}",
        f"views.large_size={args.large_size}", f"views.small_size={args.small_size}",
        f"optim.global_batch={args.batch}", "optim.epochs=1", "optim.warmup_epochs=0",
        f"run.device={args.device}", f"run.bf16={str(args.bf16).lower()}",
        f"run.channels_last={str(args.channels_last).lower()}",
        f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
    ])
    ctx = describe_environment(args.device, env={})
    derived = derive(config, world_size=1, dataset_size=args.batch * 1000)
    settings = StepSettings.from_config(config, derived, ctx)
    state = build_state(config, ctx, settings)
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    online_forward, target_forward = wrap_networks(state, ctx, compile=args.compile)
    generator = torch.Generator().manual_seed(0)
    views = [torch.randn(args.batch, 3, args.large_size, args.large_size, generator=generator)
             for _ in range(args.large_views)]
    views += [torch.randn(args.batch, 3, args.small_size, args.small_size, generator=generator)
              for _ in range(args.small_views)]
    views = [v.to(ctx.device) for v in views]

    def step() -> None:
        train_step(state, views, online_forward=online_forward, target_forward=target_forward,
                   settings=settings, ctx=ctx)

    for _ in range(args.warmup):
        step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()  # train_step reads the loss on the host, so each step ends synchronised
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    # The step's peak, read before the baseline runs (never checkpointed, it can need more memory).
    if ctx.device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
        device = torch.cuda.get_device_name()
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB peak process RSS"
        device = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    try:
        bare = bare_encoder_time(state.online, views, settings, ctx, args)
    except torch.OutOfMemoryError:
        # Expected where the step fits only with activation checkpointing: the figures above still stand.
        bare = None
        state.online.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    print(f"ResNet-{args.depth} x{args.width}, {args.large_views}x{args.large_size}px + "
          f"{args.small_views}x{args.small_size}px views, batch {args.batch}, {ctx.device.type} ({device}), "
          f"bf16={settings.bf16}, channels_last={settings.channels_last}, compile={args.compile}")
    print(f"step time median {median:.3f} s over {args.steps} steps (min {min(times):.3f}, max {max(times):.3f})")
    print(f"throughput {args.batch / median:.1f} images/s ({args.batch * (args.large_views + args.small_views) / median:.1f} views/s)")
    print(f"peak memory {peak}")
    if bare is None:
        print(f"bare encoder forward+backward: does not fit at batch {args.batch} without activation checkpointing "
              "(no baseline)")
    else:
        print(f"bare encoder forward+backward {bare:.3f} s; step / bare encoder = {median / bare:.2f}x"
              f"{' (the step with activation checkpointing, the baseline without)' if args.activation_checkpointing else ''}")


def bare_encoder_time(online: torch.nn.Module, views: list[torch.Tensor], settings, ctx, args) -> float:
    """Median time of the online network's forward + backward over all views, nothing else (the baseline)."""
    encoder = online.encoder
    dtype = None if settings.bf16 else torch.float32
    memory_format = torch.channels_last if settings.channels_last else torch.contiguous_format
    large = torch.cat(views[: args.large_views]).to(dtype=dtype, memory_format=memory_format)
    small = torch.cat(views[args.large_views :]).to(dtype=dtype, memory_format=memory_format) \
        if args.small_views else None

    # Never checkpointed: the baseline. Static shapes: the second view size would otherwise recompile the
    # encoder with dynamic shapes (slower kernels: on the H100 that baseline was slower than the whole step).
    run = torch.compile(encoder, dynamic=False) if args.compile else encoder

    def once() -> None:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            total = run(large).float().sum() + (run(small).float().sum() if small is not None else 0.0)
        total.backward()
        encoder.zero_grad(set_to_none=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        once()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()

"""ReLICv2 loss: batched implementation vs a naive per-pair, per-anchor loop (time and peak memory).

    python benchmarks/bench_loss.py                   # B=256, D=256, L=4, S=2, n_e=10, CPU, 1 thread

Both variants compute forward + backward of the same loss on the same candidates (the naive
loop replays the batched call's negative draws) and the script checks that they agree.
Time: median wall time of forward + backward over repeats. Peak memory: each variant runs in a
fresh process and reports the growth of its peak resident set size (`ru_maxrss`) over the
peak reached after building the inputs, i.e. the extra memory the loss needs at its peak.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import queue as queue_module
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from relicv2.pretrain.loss import relicv2_loss, sample_negatives

SETTINGS = {"temperature": 0.2, "contrast_weight": 0.3, "invariance_weight": 2.0}


def _inputs(args: argparse.Namespace) -> tuple[list, list, list]:
    g = torch.Generator().manual_seed(0)
    make = lambda count, grad: [  # noqa: E731
        torch.randn(args.batch, args.dim, generator=g).requires_grad_(grad) for _ in range(count)
    ]
    return make(args.large, True), make(args.small, True), make(args.large, False)


def batched(online_large, online_small, target_large, num_negatives: int) -> torch.Tensor:
    loss, _ = relicv2_loss(online_large, online_small, target_large, num_negatives=num_negatives,
                           generator=torch.Generator().manual_seed(1), **SETTINGS)
    return loss


def naive(online_large, online_small, target_large, num_negatives: int) -> torch.Tensor:
    """One softmax pair per anchor and view pair, in Python loops, as the equations read."""
    online_views = online_large + online_small
    batch = online_views[0].shape[0]
    drawn = sample_negatives(batch, num_negatives, len(online_views) * len(target_large),
                             generator=torch.Generator().manual_seed(1))
    total = 0.0
    pairs = list(itertools.product(range(len(online_views)), range(len(target_large))))
    for pair, (a, b) in enumerate(pairs):
        o = F.normalize(online_views[a], dim=-1)
        t = F.normalize(target_large[b].detach(), dim=-1)
        for i in range(batch):
            candidates = [i] + drawn[pair, i].tolist()
            forward = torch.stack([o[i] @ t[j] for j in candidates]) / SETTINGS["temperature"]
            reverse = torch.stack([o[j] @ t[i] for j in candidates]) / SETTINGS["temperature"]
            log_p, log_q = torch.log_softmax(forward, 0), torch.log_softmax(reverse, 0)
            p = log_p.exp()
            kl = (p * log_p).sum().detach() - (p * log_q).sum()
            total = total + SETTINGS["contrast_weight"] * -log_p[0] + SETTINGS["invariance_weight"] * kl
    return total / (len(pairs) * batch)


def _measure(name: str, args: argparse.Namespace, queue) -> None:
    """Run one variant in this (fresh) process: median time and peak-RSS growth."""
    torch.set_num_threads(args.threads)
    function = {"batched": batched, "naive": naive}[name]
    online_large, online_small, target_large = _inputs(args)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    repeats = args.repeats if name == "batched" else args.naive_repeats
    times, loss = [], None
    for _ in range(repeats):
        for v in online_large + online_small:
            v.grad = None
        start = time.perf_counter()
        loss = function(online_large, online_small, target_large, args.negatives)
        loss.backward()
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # numpy, not a tensor: torch would share a tensor's memory with the parent, and that memory
    # disappears when this process exits.
    grad = torch.cat([v.grad.flatten() for v in online_large + online_small]).numpy()
    queue.put((name, statistics.median(times), (peak_kib - baseline_kib) / 1024, loss.item(), grad))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--large", type=int, default=4)
    parser.add_argument("--small", type=int, default=2)
    parser.add_argument("--negatives", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--naive-repeats", type=int, default=2)
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    results = {}
    for name in ("batched", "naive"):
        queue = context.Queue()
        worker = context.Process(target=_measure, args=(name, args, queue))
        worker.start()
        while name not in results:  # read before join: a large message blocks the child's exit
            try:
                results[name] = queue.get(timeout=5)
            except queue_module.Empty:
                if not worker.is_alive():
                    sys.exit(f"the {name} run failed (exit code {worker.exitcode})")
        worker.join()
    (_, t_batched, m_batched, loss_batched, g_batched) = results["batched"]
    (_, t_naive, m_naive, loss_naive, g_naive) = results["naive"]
    agree = abs(loss_batched - loss_naive) < 1e-4 and torch.allclose(
        torch.from_numpy(g_batched), torch.from_numpy(g_naive), atol=1e-6, rtol=1e-4
    )
    print(f"ReLICv2 loss, forward + backward on CPU ({args.threads} thread(s)), torch {torch.__version__}")
    print(f"B={args.batch} D={args.dim} L={args.large} S={args.small} n_e={args.negatives} "
          f"pairs={(args.large + args.small) * args.large}")
    print(f"{'variant':<10}{'time (s)':>12}{'peak RSS growth (MiB)':>24}{'loss':>12}")
    print(f"{'batched':<10}{t_batched:>12.4f}{m_batched:>24.1f}{loss_batched:>12.5f}")
    print(f"{'naive':<10}{t_naive:>12.4f}{m_naive:>24.1f}{loss_naive:>12.5f}")
    print(f"speed-up: {t_naive / t_batched:.1f}x; results agree: {agree}")
    if not agree:
        sys.exit("batched and naive losses disagree")


if __name__ == "__main__":
    main()

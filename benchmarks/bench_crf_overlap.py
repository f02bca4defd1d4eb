"""`saliency train`'s phase I with each epoch's CRF running beside the next epoch's training, against the same
unit with each CRF awaited before the next epoch (the order before the overlap), in one run.

Both train the same phase I network (one method, `--epochs` epochs) on the same images and labels from the same
seed, alternating `--repeats` times; the labels of both are checked equal, so the ratio is the overlap's alone.
The images are photos of `--images` squared to `--size`; the labels a centred blob (their content does not change
the cost). On a GPU machine the training is the GPU's and the CRF the cores': there the overlap hides the shorter
of the two; on a CPU both share the cores.

    python benchmarks/bench_crf_overlap.py --images DIR [--count 200] [--size 112] [--epochs 3] [--workers 2]
        [--threads 1] [--repeats 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def photos(folder: Path, count: int, size: int):
    """`count` photos of `folder` (sorted by name) as uint8 [N, 3, size, size], squared by a plain resize."""
    import cv2
    import numpy as np
    import torch

    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
    images = []
    for path in paths:
        bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if bgr is not None:
            images.append(cv2.resize(bgr[:, :, ::-1], (size, size), interpolation=cv2.INTER_AREA))
        if len(images) == count:
            break
    if len(images) < count:
        raise SystemExit(f"bench_crf_overlap: {folder} holds {len(images)} readable images, fewer than --count {count}")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def run_unit(images, config, awaited: bool, out: Path, device: str) -> tuple[float, object]:
    """Wall seconds of the phase I unit and its labels; with `awaited`, each CRF is waited for as it is submitted."""
    import numpy as np
    import torch

    from relicv2.saliency.network.data import TrainingImages
    from relicv2.saliency.network.train import Trainer, TrainJob, plan_units

    size = images.shape[-1]
    yy, xx = np.mgrid[:size, :size] / size - 0.5
    blob = torch.from_numpy(np.exp(-(xx**2 + yy**2) / 0.05).astype(np.float32)).half()
    data = TrainingImages([f"i{k}" for k in range(len(images))], images, {"rbd": blob.expand(len(images), -1, -1)})
    job = TrainJob(shards=out, out=out, config=config, backbone="random", progress=False)
    trainer = Trainer(job, data, None, device)
    if awaited:  # this pool's CRFs finished before `submit` returns, as before the overlap
        submit = trainer.crf.submit

        def submit_and_wait(probabilities):
            refinement = submit(probabilities)
            refinement.result()
            return refinement

        trainer.crf.submit = submit_and_wait
    with trainer.crf:
        start = time.perf_counter()
        trainer.run_unit(plan_units(config)[0])
        seconds = time.perf_counter() - start
    return seconds, trainer.result("rbd-it1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, required=True, help="a folder of photos")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--size", type=int, default=112, help="the network's input size (and the CRF's)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="the CRF's worker processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    import torch

    from relicv2.saliency.network.config import load_saliency_config

    torch.set_num_threads(args.threads)
    settings = ["methods=rbd", f"input_size={args.size}", "iterations=1", f"workers={args.workers}"]
    config = load_saliency_config("cpu", [*settings, f"num_images={args.count}", f"epochs={args.epochs}"])
    images = photos(args.images, args.count, args.size)
    times: dict[str, list[float]] = {"awaited": [], "overlapped": []}
    labels = {}
    with tempfile.TemporaryDirectory(prefix="relicv2-crf-overlap-") as out:  # warm-up: imports, caches, allocator
        warm_up = load_saliency_config("cpu", [*settings, "num_images=8", "epochs=1"])
        run_unit(images[:8], warm_up, False, Path(out), args.device)
    for repeat in range(args.repeats):
        for name in ("awaited", "overlapped"):
            with tempfile.TemporaryDirectory(prefix="relicv2-crf-overlap-") as out:
                seconds, labels[name] = run_unit(images, config, name == "awaited", Path(out), args.device)
            times[name].append(seconds)
            print(f"repeat {repeat}: CRF {name:<10} {seconds:7.1f} s", flush=True)
    if not torch.equal(labels["awaited"], labels["overlapped"]):
        raise SystemExit("bench_crf_overlap: the two orders gave different labels")
    awaited, overlapped = statistics.median(times["awaited"]), statistics.median(times["overlapped"])
    print(f"{args.count} images at {args.size} px, {args.epochs} epochs, {args.workers} CRF workers, "
          f"{args.threads} training thread(s) on {args.device}; the labels of both are equal")
    print(f"phase I network, median of {args.repeats}: CRF awaited {awaited:.1f} s, overlapped {overlapped:.1f} s: "
          f"{awaited / overlapped:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ReLICv2 (this project's Imagenette preset) vs lightly's SimCLR at the same wall-clock budget.

Same data (an Imagenette shard set), same ResNet-18 (this project's `resnet(18)`), same view size
(64 px), same batch (128), same machine, and the same time: the ReLICv2 run goes first with a schedule of `--relic-epochs`
epochs, the time it took (process start to final checkpoint) becomes the peer's budget, and the
peer's cosine learning-rate schedule runs over that time. The default clock is CPU seconds: on a
machine shared with other jobs wall clock measures the neighbours' load as much as the method
(`--clock wall` for a quiet machine); both are recorded. Both encoders
are exported (`models.encoder_file`) and scored with this project's kNN (k 20, T 0.07) and linear
`fast` protocol at 64 px, beside a randomly initialised ResNet-18.

    python benchmarks/peer_ssl.py train --train-shards S/train --out OUT [--relic-epochs 2]
    python benchmarks/peer_ssl.py score --train-shards S/train --val-shards S/val --out OUT

The peer uses lightly's own pieces (SimCLRTransform, SimCLRProjectionHead, NTXentLoss) and
lightly's Imagenette benchmark optimiser (SGD, lr 0.06 * batch / 128, momentum 0.9, weight decay
5e-4, cosine); only the blur sigma is scaled to 64 px views as in the ReLICv2 preset. lightly is a
benchmark-only dependency (requirements-dev.lock).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relicv2.models.encoder_file import load_encoder_file, save_encoder_file  # noqa: E402
from relicv2.models.resnet import resnet  # noqa: E402
from relicv2.shards import ReadReport, iter_samples, resolve_shard_set  # noqa: E402

VIEW_SIZE = 64
BATCH = 128
DEPTH = 18


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def train_relicv2(train_shards: Path, out: Path, epochs: int, overrides: tuple[str, ...] = ()) -> dict:
    """Run the project's Imagenette preset for `epochs` epochs (no kNN monitor), with `--set` overrides;
    return wall/CPU seconds."""
    run_dir = out / "relicv2-run"
    command = [sys.executable, "-m", "relicv2", "pretrain", "--config", "imagenette-r18-cpu",
               "--set", f"optim.epochs={epochs}", "--set", f"data.train_shards={train_shards}",
               "--set", "knn.train_shards=", "--set", "knn.val_shards=", "--set", "run.checkpoint_every=100000",
               "--output", str(run_dir), "--fresh"]
    for override in overrides:
        command += ["--set", override]
    start, cpu_start = time.perf_counter(), _cpu_seconds(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    cpu = _cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_start
    from relicv2.pretrain.checkpoint import encoder_from_checkpoint, resolve_checkpoint

    checkpoint = resolve_checkpoint(run_dir)
    save_encoder_file(encoder_from_checkpoint(checkpoint), out / "relicv2.pt", depth=DEPTH, width=1,
                      metadata={"method": "relicv2", "wall_s": wall, "epochs": epochs, "source": str(checkpoint)})
    return {"wall_s": wall, "cpu_s": cpu, "epochs": epochs, "overrides": list(overrides)}


class _JpegDataset(torch.utils.data.Dataset):
    """Every JPEG of a shard set held in memory (Imagenette-112: ~70 MB), two SimCLR views each."""

    def __init__(self, jpegs: list[bytes], transform) -> None:
        self.jpegs, self.transform = jpegs, transform

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, index: int):
        from PIL import Image

        with Image.open(io.BytesIO(self.jpegs[index])) as image:
            views = self.transform(image.convert("RGB"))
        return views[0], views[1]


def train_simclr(train_shards: Path, out: Path, budget_s: float, clock: str) -> dict:
    """lightly SimCLR on this project's ResNet-18 for `budget_s` seconds of `clock` ("cpu" or "wall").

    Images are decoded in the training process (no DataLoader workers) so that its CPU time is
    all the work it did; ReLICv2's DALI threads live in its process too.
    """
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead
    from lightly.transforms import SimCLRTransform

    start = time.perf_counter()
    cpu_start = _cpu_seconds(resource.RUSAGE_SELF)
    torch.manual_seed(0)
    random.seed(0)
    jpegs = [sample["image"] for sample in iter_samples(train_shards, report=ReadReport())]
    transform = SimCLRTransform(input_size=VIEW_SIZE, sigmas=(0.1, 0.6))
    loader = torch.utils.data.DataLoader(_JpegDataset(jpegs, transform), batch_size=BATCH, shuffle=True,
                                         drop_last=True, num_workers=0)

    def spent() -> float:
        if clock == "wall":
            return time.perf_counter() - start
        return _cpu_seconds(resource.RUSAGE_SELF) - cpu_start

    encoder = resnet(DEPTH)
    head = SimCLRProjectionHead(encoder.num_features, 512, 128)
    criterion = NTXentLoss(temperature=0.1)
    peak_lr = 0.06 * BATCH / 128
    params = [*encoder.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=peak_lr, momentum=0.9, weight_decay=5e-4)
    steps = 0
    epochs = 0
    done = False
    while not done:
        for view_a, view_b in loader:
            elapsed = spent()
            if elapsed >= budget_s:
                done = True
                break
            # The cosine schedule runs over the time budget instead of a step count.
            for group in optimizer.param_groups:
                group["lr"] = peak_lr * 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
            loss = criterion(head(encoder(view_a)), head(encoder(view_b)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % 10 == 0:
                print(f"simclr step {steps} epoch {epochs} loss {loss.item():.4f} {elapsed:.0f}/{budget_s:.0f}s",
                      flush=True)
        epochs += 1
    wall = time.perf_counter() - start
    cpu = _cpu_seconds(resource.RUSAGE_SELF) - cpu_start
    info = {"method": "lightly-simclr", "wall_s": wall, "cpu_s": cpu, "steps": steps, "epochs": epochs,
            "images_seen": steps * BATCH, "budget_s": budget_s, "budget_clock": clock}
    save_encoder_file(encoder, out / "simclr.pt", depth=DEPTH, width=1, metadata=info)
    return info


@click.group()
def main() -> None:
    """Peer baseline: lightly SimCLR vs ReLICv2 at equal wall clock."""


@main.command()
@click.option("--train-shards", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--relic-epochs", type=int, default=2, show_default=True)
@click.option("--relic-set", "relic_sets", multiple=True, metavar="KEY=VALUE",
              help="Override a setting of the ReLICv2 preset, e.g. --relic-set views.small_views=0 (repeatable).")
@click.option("--budget-s", type=float, default=0.0, help="Peer budget; 0: what the ReLICv2 run used.")
@click.option("--clock", type=click.Choice(["cpu", "wall"]), default="cpu", show_default=True,
              help="Budget in CPU seconds (fair on a shared, loaded machine) or wall-clock seconds.")
def train(train_shards: Path, out: Path, relic_epochs: int, relic_sets: tuple[str, ...], budget_s: float,
          clock: str) -> None:
    """Train ReLICv2 (preset, `--relic-epochs`) then lightly SimCLR for the same wall clock."""
    out.mkdir(parents=True, exist_ok=True)
    record = out / "train.json"
    results = json.loads(record.read_text()) if record.is_file() else {}
    if "relicv2" not in results:
        results["relicv2"] = train_relicv2(train_shards, out, relic_epochs, relic_sets)
        record.write_text(json.dumps(results, indent=2))
    budget = budget_s or results["relicv2"][f"{clock}_s"]
    if "simclr" not in results:
        results["simclr"] = train_simclr(train_shards, out, budget, clock)
        record.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


@main.command()
@click.option("--train-shards", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--val-shards", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--encoder", "encoders", multiple=True, metavar="NAME=FILE",
              help="Score these exported encoders instead of OUT/relicv2.pt and OUT/simclr.pt (repeatable).")
def score(train_shards: Path, val_shards: Path, out: Path, encoders: tuple[str, ...]) -> None:
    """kNN and linear-fast (64 px) of the exported encoders and of a random-init ResNet-18."""
    from relicv2.evaluation.features import FeatureSpec, cached_features
    from relicv2.evaluation.linear import LinearConfig, train_linear_on_features
    from relicv2.pretrain.checkpoint import random_encoder
    from relicv2.pretrain.knn.classify import knn_predict

    spec = FeatureSpec(crop_size=VIEW_SIZE, resize_size=VIEW_SIZE)
    train_shards, val_shards = resolve_shard_set(train_shards), resolve_shard_set(val_shards)  # once for every encoder
    train_info = json.loads((out / "train.json").read_text()) if (out / "train.json").is_file() else {}
    files = dict(item.split("=", 1) for item in encoders) or {"relicv2": out / "relicv2.pt",
                                                              "lightly-simclr": out / "simclr.pt"}
    rows = []
    for name, encoder in (("random-init", random_encoder(DEPTH)),
                          *((name, load_encoder_file(path)) for name, path in files.items())):
        train_set = cached_features(encoder, train_shards, spec, cache_dir=out / "features" / name)
        val_set = cached_features(encoder, val_shards, spec, cache_dir=out / "features" / name)
        num_classes = int(max(train_set.labels.max(), val_set.labels.max())) + 1
        predicted = knn_predict(train_set.features, train_set.labels, val_set.features, num_classes=num_classes)
        knn_top1 = float((predicted == val_set.labels).float().mean())
        linear = train_linear_on_features(train_set, val_set, LinearConfig(protocol="fast"), num_classes=num_classes)
        wall = train_info.get(name.removeprefix("lightly-"), {}).get("wall_s")
        rows.append({"method": name, "train_wall_s": wall, "knn_top1": knn_top1,
                     "linear_fast_top1": linear.top1, "linear_fast_top5": linear.top5})
        print(json.dumps(rows[-1]), flush=True)
    (out / "score.json").write_text(json.dumps(rows, indent=2))
    print("| method | train wall (s) | kNN top-1 | linear-fast top-1 | top-5 |")
    print("|---|---|---|---|---|")
    for row in rows:
        wall = f"{row['train_wall_s']:.0f}" if row["train_wall_s"] else "-"
        print(f"| {row['method']} | {wall} | {row['knn_top1']:.4f} | {row['linear_fast_top1']:.4f} | "
              f"{row['linear_fast_top5']:.4f} |")


if __name__ == "__main__":
    main()

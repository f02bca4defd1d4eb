"""`relicv2 saliency train`: DeepUSPS-style refinement of handcrafted maps and the fused saliency network.

Steps (docs/design.md "Refinement (DeepUSPS-style) and the saliency network"):
1. sample N images, compute the handcrafted maps (cached; `data.py`);
2. phase I, per method, K iterations: a fresh network trained E epochs on the current binary
   labels; after each epoch its train-mode predictions are CRF-refined and folded into a moving
   average (`average_keep` old + the rest new, from 0); the last average binarised at 0.5 is the
   next labels;
3. phase II: a fresh network trained on all methods' refined labels at once (K = 0: on the
   handcrafted maps' labels, with no phase I);
4. optional report against ground truth (`--gt`), and on held-back shards (`--eval-shards`);
5. `OUT/model.pt` (self-describing) and `OUT/report.json`.
Every unit of work (one iteration of one method, or the fused network) checkpoints after each
epoch into `OUT/work/`; rerunning the same command resumes at the epoch after the last one saved.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from relicv2.jobs.atomic import atomic_write_bytes, remove_stale_temps
from relicv2.jobs.config import SETTINGS_FILE, load_yaml, settings_text, to_dict
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.jobs.version import package_version
from relicv2.models.resnet import load_torchvision_state_dict
from relicv2.models.torchfile import StateDict, TorchFormat
from relicv2.saliency.network.config import SaliencyTrainConfig
from relicv2.saliency.network.crf import CrfPool
from relicv2.saliency.network.data import TrainingImages, load_training_images
from relicv2.saliency.network.images import sample_locations
from relicv2.saliency.network.loop import train_epoch
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import save_model
from relicv2.saliency.network.report import check_ground_truth, evaluate_report, format_report
from relicv2.saliency.network.weights import encoder_state_dict, load_fitting
from relicv2.shards.outdir import check_output_folder, writing
from relicv2.shards.reader import SampleRef

RANDOM_BACKBONE_NOTE = ("saliency train: note: the encoder starts from random weights (--backbone random); "
                        "the paper starts it from a self-supervised backbone (a relicv2 pretrain run folder); "
                        "benchmarks/RESULTS.md measures what that buys at small scale")


def few_images_note(config: SaliencyTrainConfig, count: int) -> str | None:
    """A note when the shard set holds fewer images than `num_images`: every network then takes fewer steps
    than the preset's epochs were chosen for (the levers of RESULTS.md are steps as much as images)."""
    if count >= config.num_images:
        return None
    scale = config.num_images / count
    epochs = f"--set epochs={math.ceil(config.epochs * scale)} " if config.iterations else ""  # phase I's
    return (f"saliency train: note: {count} images, fewer than num_images={config.num_images} that the preset's "
            f"epochs were chosen for, so each network takes {count / config.num_images:.0%} of those steps; for "
            f"as many steps: {epochs}--set fuse_epochs={math.ceil(config.fuse_epochs * scale)}")


# A unit's work files in OUT/work: NAME.current.pt after each epoch, NAME.done.pt once it is trained.
CURRENT = TorchFormat("saliency training work file", fix="delete it: a rerun trains that network from its start",
                      fields={"epoch": int, "model": StateDict, "optimizer": dict, "average": torch.Tensor,
                              "losses": list})
DONE = TorchFormat("saliency training result", fix="delete it: a rerun trains that network again",
                   fields={"losses": list, "average": torch.Tensor})
FUSED_DONE = replace(DONE, fields={**DONE.fields, "model": StateDict})


def _pending_predictions(path: Path, state: dict, shape: tuple[int, ...]) -> np.ndarray:
    """A work file's predictions whose CRF was still running when it was written, checked against its average."""
    pending = state["pending"]
    if not isinstance(pending, torch.Tensor) or tuple(pending.shape) != shape:
        found = tuple(pending.shape) if isinstance(pending, torch.Tensor) else type(pending).__name__
        raise CURRENT.fail(path, f"is damaged: its pending predictions are {found}, not {shape}")
    return pending.float().numpy()


class TrainStateError(RuntimeError):
    """The output folder holds a run that this command cannot continue."""


@dataclass(frozen=True)
class TrainJob:
    """One `relicv2 saliency train` job."""

    shards: Path
    out: Path
    config: SaliencyTrainConfig
    backbone: str  # a weights file, a pretrain run folder, or "random"
    gt: Path | None = None  # ground-truth masks named like the sample keys (report only)
    eval_shards: Path | None = None  # held-back images to score the fused network on (needs gt)
    progress: bool = True
    # Where indexes of shards without one (plain WebDataset tars) are derived; None: the default
    # cache (shards.shardset.default_index_cache). Not a setting of the run: resuming may use another.
    index_cache: Path | None = None


@dataclass(frozen=True)
class Unit:
    """One network trained from scratch: a phase I iteration of a method, or the fused network."""

    name: str
    method: str | None  # None: phase II (all methods)
    iteration: int
    epochs: int
    lr: float
    beta2: float

    @property
    def seed_offset(self) -> int:
        return zlib.crc32(self.name.encode())


def plan_units(config: SaliencyTrainConfig) -> list[Unit]:
    units = [Unit(f"{m}-it{k + 1}", m, k, config.epochs, config.lr * config.lr_growth**k, config.phase1_beta2)
             for m in config.methods for k in range(config.iterations)]
    return [*units, Unit("fused", None, 0, config.fuse_epochs, config.fuse_lr, config.fuse_beta2)]


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def config_differences(old: dict, new: dict) -> list[str]:
    """`name: OLD there, NEW now` for each setting that differs (settings named as `--set` spells them)."""
    before, after = _flatten(old), _flatten(new)
    absent = "(absent)"
    return [f"{k}: {before.get(k, absent)} there, {after.get(k, absent)} now"
            for k in sorted(before.keys() | after.keys()) if before.get(k, absent) != after.get(k, absent)]


def _check_config(out: Path, text: str) -> bool:
    """Refuse an earlier run in `out` with other settings; True when `config.yaml` must be written. A
    config.yaml beside nothing else (an earlier version wrote it before a failed check) is not a run, and
    is replaced; the version that wrote it does not count."""
    path = out / SETTINGS_FILE
    if not path.is_file():
        return True
    try:
        old = load_yaml(path.read_text(), str(path))
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise TrainStateError(f"{path} cannot be read ({error}); choose another --out") from None
    new = load_yaml(text, SETTINGS_FILE)
    for tree in (old, new):
        if isinstance(tree, dict):
            tree.pop("version", None)
    if old == new:
        return False
    if not ((out / "sample" / "info.json").is_file() or (out / "work").is_dir()):  # no run began there
        return True
    differences = config_differences(old if isinstance(old, dict) else {}, new)
    raise TrainStateError(
        f"{out} holds a saliency run with other settings ({path}: {'; '.join(differences)}); rerun with the "
        "same options to resume it, or choose another --out"
    )


@dataclass(frozen=True)
class CheckedInputs:
    """What `check_inputs` found usable: the seeded sample of --shards and the encoder weights."""

    locations: list[SampleRef]
    encoder_state: dict | None  # None: random initialisation
    backbone: str  # where the encoder weights came from, in words


def check_inputs(job: TrainJob) -> CheckedInputs:
    """Check every input of the job before anything is written to OUT (a ValueError naming the option):
    --shards, --backbone, --eval-shards and --gt."""
    config = job.config
    if config.fuse_epochs < 1:
        raise ValueError("fuse_epochs must be >= 1: the fused network is the job's output")
    if job.eval_shards is not None and job.gt is None:
        raise ValueError("--eval-shards needs --gt (the held-back images are only scored against their masks)")
    try:
        locations = sample_locations(job.shards, config.num_images, config.seed, index_cache=job.index_cache)
    except ValueError as error:  # ShardSetError, or a set without images
        raise ValueError(f"--shards: {error}") from None
    if job.backbone == "random":
        encoder_state, backbone = None, "random initialisation"
    else:
        encoder_state, backbone = encoder_state_dict(job.backbone, config.depth, config.width)
        # fail now, not after the maps: the weights must fit the encoder
        load_fitting(SaliencyNet(config.depth, config.width).encoder, encoder_state, f"--backbone {job.backbone}",
                     config.depth, config.width)
    if job.gt is not None:
        keys = [loc.key for loc in locations]
        if job.eval_shards is not None:
            try:
                held = sample_locations(job.eval_shards, sys.maxsize, 0, index_cache=job.index_cache)
            except ValueError as error:
                raise ValueError(f"--eval-shards: {error}") from None
            keys += [loc.key for loc in held]
        check_ground_truth(Path(job.gt), keys)
    return CheckedInputs(locations, encoder_state, backbone)


class Trainer:
    """Runs the units in order, each resumable; holds the images and the encoder weights in memory."""

    def __init__(self, job: TrainJob, data: TrainingImages, encoder_state: dict | None, device: str | None = None):
        self.job, self.config, self.data = job, job.config, data
        self.encoder_state = encoder_state
        self.work = Path(job.out) / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.device = device or resolve_device(self.config.device)
        images_hwc = data.images.permute(0, 2, 3, 1).contiguous().numpy()
        self.crf = CrfPool(images_hwc, self.config.crf.at_size(self.config.input_size), self.config.workers)

    def fresh_network(self, unit: Unit) -> SaliencyNet:
        torch.manual_seed(self.config.seed * 1_000_003 + unit.seed_offset)
        model = SaliencyNet(self.config.depth, self.config.width)
        if self.encoder_state is not None:
            load_torchvision_state_dict(model.encoder, self.encoder_state)
        return model.to(self.device)

    def labels_of(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """(binary labels [N, M, S, S], the soft maps they were binarised from [N, M, S, S])."""
        methods = [unit.method] if unit.method else list(self.config.methods)
        labels, soft = [], []
        k = unit.iteration if unit.method else self.config.iterations  # the labels' round (0: handcrafted)
        for m in methods:
            if k == 0:  # the handcrafted map (phase II too when there is no phase I)
                soft_map, threshold = self.data.maps[m].float(), self.config.thresholds[m]
            else:  # the refined labels of the round before (phase II: the last)
                soft_map, threshold = self.result(f"{m}-it{k}").float(), 0.5
            labels.append((soft_map >= threshold).half())
            soft.append(soft_map.half())
        return torch.stack(labels, 1), torch.stack(soft, 1)

    def fused_labels(self) -> torch.Tensor:
        """What phase II fits: binary labels [N, M, S, S], one set per method."""
        return self.labels_of(plan_units(self.config)[-1])[0]

    def result(self, name: str) -> torch.Tensor:
        """The refined soft labels (moving average) a finished phase I unit left."""
        return DONE.load(self.work / f"{name}.done.pt")["average"]

    def run_unit(self, unit: Unit) -> None:
        done = self.work / f"{unit.name}.done.pt"
        if done.is_file():
            return
        labels, soft = self.labels_of(unit)
        model = self.fresh_network(unit)
        optimizer = torch.optim.Adam(model.parameters(), lr=unit.lr)
        n, size = self.data.images.shape[0], self.config.input_size
        average = np.zeros((n, size, size), dtype=np.float32)
        start, losses, pending = 0, [], None
        current = self.work / f"{unit.name}.current.pt"
        if current.is_file():
            state = CURRENT.load(current)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            average = state["average"].float().numpy()
            start, losses = int(state["epoch"]), list(state["losses"])
            if state.get("pending") is not None:
                pending = self.crf.submit(_pending_predictions(current, state, average.shape))
        keep = self.config.average_keep
        bar = Phase(f"saliency {unit.name}", unit.epochs * n, unit="img", enabled=self.job.progress,
                    initial=start * n)
        for epoch in range(start, unit.epochs):
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + unit.seed_offset + epoch)
            order = torch.randperm(n, generator=generator)
            predictions, loss = train_epoch(
                model, optimizer, self.data.images, labels, soft, order=order,
                batch_size=self.config.batch_size, beta2=unit.beta2, device=self.device, progress=bar,
            )
            losses.append(loss)
            bar.set_postfix(loss=loss)
            state = {"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "losses": losses}
            if unit.method is not None:
                # The CRF of this epoch's predictions runs in the workers while the next epoch trains (on a GPU
                # machine most of a phase I epoch is its CRF); the moving average takes each epoch's in order,
                # so the labels are those of refining every epoch before the next.
                if pending is not None:
                    average = keep * average + (1 - keep) * pending.result()
                pending = self.crf.submit(predictions)
                state["pending"] = torch.from_numpy(predictions)  # its CRF not yet averaged: redone on resume
            state["average"] = torch.from_numpy(average)  # fp32: exact resume
            CURRENT.save(current, state)
        if pending is not None:
            average = keep * average + (1 - keep) * pending.result()
        bar.close()
        result = {"losses": losses, "average": torch.from_numpy(average).half()}
        if unit.method is None:
            result["model"] = model.state_dict()
        DONE.save(done, result)
        current.unlink(missing_ok=True)

    def fused_network(self) -> SaliencyNet:
        model = SaliencyNet(self.config.depth, self.config.width)
        model.load_state_dict(FUSED_DONE.load(self.work / "fused.done.pt")["model"])
        return model.eval()

    def losses(self) -> dict[str, list[float]]:
        return {p.name[: -len(".done.pt")]: DONE.load(p)["losses"]
                for p in sorted(self.work.glob("*.done.pt"))}


def run_train(job: TrainJob, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the job; returns the report written to `OUT/report.json`."""
    config, out = job.config, Path(job.out)
    check_output_folder(out, "--out")
    device = resolve_device(config.device)  # "auto" stays in config.yaml: a resumed run may use another machine
    checked = check_inputs(job)  # before OUT exists: a mistake leaves nothing behind
    with folder_lock(out, "relicv2 saliency train"):
        if stale := remove_stale_temps(out, recursive=True):  # alone in the folder: every temporary is a killed run's
            print(f"removed {stale} stale temporary file(s) left by an interrupted run in {out}", file=sys.stderr)
        text = settings_text(config, extra={"inputs": {"shards": str(job.shards), "backbone": job.backbone}},
                             version=package_version())
        if _check_config(out, text):
            atomic_write_bytes(out / SETTINGS_FILE, text.encode())
        log(text.rstrip())
        if config.threads:
            torch.set_num_threads(config.threads)
        if checked.encoder_state is None:
            print(RANDOM_BACKBONE_NOTE, file=sys.stderr)
        log(f"saliency train: preset {config.preset}, ResNet-{config.depth} x{config.width}, "
            f"{config.input_size} px, encoder from {checked.backbone}, on {device}")
        note = few_images_note(config, len(checked.locations))
        if note:
            print(note, file=sys.stderr)
        data = load_training_images(job.shards, out, count=config.num_images, seed=config.seed,
                                    size=config.input_size, methods=config.methods, workers=config.workers,
                                    progress=job.progress, index_cache=job.index_cache, locations=checked.locations)
        for key, reason in data.skipped:
            print(f"saliency train: left out {key}: {reason}", file=sys.stderr)
        log(f"saliency train: {len(data.keys)} images ({len(data.skipped)} left out)")
        trainer = Trainer(job, data, checked.encoder_state, device)
        with trainer.crf:  # left by an exception (Ctrl-C), the CRFs not yet started are dropped
            for unit in plan_units(config):
                trainer.run_unit(unit)
        model = trainer.fused_network()
        report = {"preset": config.preset, "backbone": checked.backbone, "images": len(data.keys),
                  "left_out": [list(s) for s in data.skipped], "losses": trainer.losses()}
        if job.gt is not None:
            report.update(evaluate_report(job, data, trainer, model, progress=job.progress))
            log(format_report(report))
        # JSON has no NaN: every NaN or infinite float (a diverged epoch's loss) is written as null.
        finite = json.loads(json.dumps(report), parse_constant=lambda _: None)
        text = json.dumps(finite, indent=2, sort_keys=True, allow_nan=False)  # strict JSON
        with writing(out, "--out", errors=(OSError, RuntimeError)):  # torch.save fails with a RuntimeError
            atomic_write_bytes(out / "report.json", (text + "\n").encode())
            save_model(out / "model.pt", model, input_size=config.input_size, preset=config.preset,
                       backbone=checked.backbone, config=to_dict(config), report=report)
        log(f"saliency train: wrote {out / 'model.pt'} and {out / 'report.json'}")
        return report

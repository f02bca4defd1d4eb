"""The `relicv2 eval` jobs (kNN, linear probe, fine-tuning) as one library function, `run_eval`: load the
backbone, print the settings and save them as `config.yaml` in the output folder, evaluate, write the JSON
records and return what the command prints. Under torchrun every rank calls it; rank 0 gets the result.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relicv2.evaluation.export import load_backbone
from relicv2.evaluation.finetune import FinetuneConfig, finetune
from relicv2.evaluation.head_file import TRAINED_HEAD_FILE
from relicv2.evaluation.linear import LinearConfig, evaluate_linear
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.config import (
    SETTINGS_FILE,
    ConfigError,
    Presets,
    build,
    is_file_reference,
    resolve,
    settings_text,
    to_dict,
)
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.version import package_version
from relicv2.pretrain import distributed
from relicv2.pretrain.checkpoint import random_encoder
from relicv2.pretrain.config import KnnConfig
from relicv2.pretrain.knn.classify import at_trained_size, evaluate_knn, shared_tars
from relicv2.pretrain.knn.outcome import NAMED_KEYS, lost_text, named
from relicv2.shards.outdir import check_output_file, check_output_folder, writing
from relicv2.shards.shardset import ShardSetError, resolve_shard_set
from relicv2.shards.subset import read_key_list

LINEAR_PRESETS = Presets(job="relicv2 eval linear", package="relicv2.evaluation", folder="presets/linear")
FINETUNE_PRESETS = Presets(job="relicv2 eval finetune", package="relicv2.evaluation", folder="presets/finetune")
ALLOW_LOST_HINT = ", or pass --allow-lost to score the samples that remain (the loss is then in every output)"


def load_linear_config(config: str | Path = "paper", overrides: Sequence[str] = ()) -> LinearConfig:
    """A linear-probe preset (`paper`, `fast`) or YAML file, with `key=value` overrides."""
    return resolve(LinearConfig, config, overrides, LINEAR_PRESETS)


def load_finetune_config(config: str | Path = "1pct", overrides: Sequence[str] = ()) -> FinetuneConfig:
    """A fine-tuning preset (`1pct`, `10pct`) or YAML file, with `key=value` overrides; `preset` names it."""
    label = Path(config).stem if is_file_reference(config) else str(config)
    return resolve(FinetuneConfig, config, overrides, FINETUNE_PRESETS, defaults={"preset": label})


def knn_settings(given: dict[str, Any]) -> KnnConfig:
    """`KnnConfig` (the one owner of the kNN defaults) with the options a user gave, checked."""
    return build(KnnConfig, {k: v for k, v in given.items() if v is not None}, source="relicv2 eval knn")


@dataclass(frozen=True)
class Backbone:
    """The encoder to evaluate: `checkpoint` (run folder, checkpoint or exported file) or `random_depth`."""

    checkpoint: Path | None = None
    random_depth: int | None = None
    network: str = "online"  # of a pretraining checkpoint: "online" or "target"
    seed: int = 0  # of the random initialisation

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.random_depth is None):
            raise ConfigError("give exactly one of --checkpoint or --random-init DEPTH")

    def describe(self) -> str:
        return f"random-init ResNet-{self.random_depth}" if self.checkpoint is None else str(self.checkpoint)

    def as_dict(self) -> dict[str, Any]:
        return {"checkpoint": None if self.checkpoint is None else str(self.checkpoint),
                "random_init": self.random_depth, "network": self.network, "seed": self.seed}


def load_encoder(backbone: Backbone) -> tuple[Any, dict[str, Any]]:
    """(encoder, description: "checkpoint", "network", "step", "trained_protocol", ...) of a `Backbone`."""
    if backbone.checkpoint is not None:
        return load_backbone(backbone.checkpoint, network=backbone.network)
    return random_encoder(backbone.random_depth, seed=backbone.seed), {
        "checkpoint": None, "network": None, "step": None, "trained_protocol": {}}


@dataclass(frozen=True)
class EvalJob:
    """One evaluation: what to evaluate, on which sets, with which settings, and where results go."""

    backbone: Backbone
    train_shards: Path
    val_shards: Path
    config: LinearConfig | FinetuneConfig | KnnConfig
    output: Path | None = None  # caches, head checkpoints, config.yaml and result.json
    json_path: Path | None = None  # the result as JSON here too
    device: str = "auto"
    allow_lost: bool = False
    labels: Path | None = None  # fine-tuning: the key list of the labelled subset
    # The settings the user gave; the others follow the encoder's own training (`trained_protocol`).
    given: frozenset[str] = frozenset()

    @property
    def command(self) -> str:
        kind = {LinearConfig: "linear", FinetuneConfig: "finetune", KnnConfig: "knn"}[type(self.config)]
        return f"relicv2 eval {kind}"

    @property
    def inputs(self) -> dict[str, Any]:
        """What the job reads, as printed and saved with its settings."""
        inputs = {"backbone": self.backbone.as_dict(), "train": str(self.train_shards), "val": str(self.val_shards)}
        return inputs if self.labels is None else {**inputs, "labels": str(self.labels)}


@dataclass(frozen=True)
class EvalOutcome:
    """What rank 0 got: the lines the command prints, and its warnings."""

    lines: list[str]
    warnings: list[str]


def run_eval(job: EvalJob, log: Callable[[str], None] = print) -> EvalOutcome | None:
    """Run `job`; the outcome on rank 0 (None on the other ranks). Errors a user can cause raise:
    LostSamplesError, FolderLockedError, FileNotFoundError, ValueError (OutputError, ShardSetError and
    models.torchfile's TorchFileError among them)."""
    check_outputs(job.output, job.json_path)
    if isinstance(job.config, KnnConfig):
        return _run_knn(job, log)
    return _run_trained_head(job, log)


def _run_knn(job: EvalJob, log: Callable[[str], None]) -> EvalOutcome:
    device = resolve_device(job.device, "--device")
    # The job's one resolution of --train and --val, with `allow_lost` (the reading refuses, or with
    # --allow-lost counts, what their tars lost); a bank that holds its queries finds each in itself.
    train, val = (resolve_shard_set(spec, allow_lost=True) for spec in (job.train_shards, job.val_shards))
    if both := shared_tars(train, val):
        raise ShardSetError(f"--train and --val share {len(both)} tar(s) ({both[0].name}, ...): each query would "
                            "be found in the bank itself; pass a held-out labelled set as --val")
    encoder, record = load_encoder(job.backbone)
    trained = record["trained_protocol"]
    # Unset options follow the checkpoint's training (its run's kNN monitor, else its view size), so the
    # figure matches the run's own; KnnConfig checks the values as for a user's.
    settings = build(KnnConfig, {**{k: v for k, v in trained.items() if k not in job.given},
                                 **{k: getattr(job.config, k) for k in job.given}}, source=job.command)
    warnings = []
    if "crop_size" in trained and settings.crop_size != trained["crop_size"]:
        warnings.append(f"warning: the encoder was evaluated at {trained['crop_size']} px in its own run (or trained "
                        f"on views of that size); --crop-size {settings.crop_size} gives a figure not comparable "
                        "with it")
    save_settings(None, settings, job.inputs, log)
    result = evaluate_knn(encoder.to(device), train, val, settings=settings, device=device, progress=True,
                          allow_lost=job.allow_lost)
    assert result is not None  # a single process is rank 0
    what = (f"{record['checkpoint']} ({record['network']})" if job.backbone.checkpoint is not None
            else job.backbone.describe())
    source = "the checkpoint's own protocol" if trained else "the defaults"
    line = (f"{what}: kNN top-1 {result.top1:.4f} (on {device}, {settings.crop_size} px, k={settings.k}, "
            f"T={settings.temperature}: {source} where not set; {result.num_train} train, {result.num_val} val, "
            f"{result.skipped} undecodable skipped, {lost_text(result.lost)} lost while reading)")
    payload = result.as_json(checkpoint=record["checkpoint"], random_init=job.backbone.random_depth, extra={
        "network": record["network"]})
    write_json(payload, (job.json_path, "--json"))
    return EvalOutcome([line], warnings + _shortfalls(result))


def _run_trained_head(job: EvalJob, log: Callable[[str], None]) -> EvalOutcome | None:
    keys = read_key_list(job.labels) if job.labels is not None else None  # a bad list is refused first
    ctx = distributed.init(job.device, option="--device")
    try:
        with folder_lock(job.output, job.command, enabled=ctx.rank == 0) if job.output else contextlib.nullcontext():
            encoder, record = load_encoder(job.backbone)
            # The image size follows the encoder's training unless the user set one.
            config = at_trained_size(job.config, record["trained_protocol"], job.given)
            if ctx.rank == 0:
                save_settings(job.output, config, job.inputs, log)
            if isinstance(config, LinearConfig):
                result = evaluate_linear(encoder, job.train_shards, job.val_shards, config, device=ctx.device,
                                         output_dir=job.output, ctx=ctx, allow_lost=job.allow_lost)
            elif keys is None:
                raise ValueError("fine-tuning needs the key list of the labelled subset (--labels)")
            else:
                result = finetune(encoder, job.train_shards, job.val_shards, keys, config, device=ctx.device,
                                  output_dir=job.output, ctx=ctx)
    finally:
        distributed.teardown(ctx)
    if ctx.rank != 0:
        return None
    extra = {"network": record["network"], "step": record["step"], "world_size": ctx.world_size,
             **({"labels": str(job.labels)} if job.labels is not None else {}), "config": to_dict(config)}
    if isinstance(config, LinearConfig) and job.output is not None:
        extra["head_file"] = str(job.output / TRAINED_HEAD_FILE)
    payload = result.as_json(checkpoint=record["checkpoint"], random_init=job.backbone.random_depth, extra=extra)
    write_json(payload, (job.json_path, "--json"), (job.output / "result.json" if job.output else None, "--output"))
    title = f"{result.protocol} of {record['checkpoint'] or job.backbone.describe()}"
    return EvalOutcome(_table(title, payload, lost_text(result.lost), ctx.device), _shortfalls(result))


def _table(title: str, payload: dict[str, Any], lost: str, device: object) -> list[str]:
    """The result as a two-column table (the human-readable twin of the JSON)."""
    top5 = payload["top5"]
    rows = [("protocol", payload["protocol"]), ("device", str(device)), ("top-1", f"{payload['top1']:.4f}"),
            ("top-5", f"{top5:.4f}" if top5 is not None else "- (fewer than 5 classes)"),
            ("train images", str(payload["num_train"])), ("val images", str(payload["num_val"])),
            ("undecodable skipped", str(payload["skipped"])), ("lost while reading", lost)]
    width = max(len(name) for name, _ in rows)
    return [title, "-" * max(len(title), width + 14), *(f"{name.ljust(width)}  {value}" for name, value in rows)]


def _shortfalls(result: Any) -> list[str]:
    """One line per kind of sample an evaluation left out: undecodable images by key, lost samples by set."""
    lines = []
    if result.skipped_keys:
        more = " (all in --json)" if len(result.skipped_keys) > NAMED_KEYS else ""
        lines.append(f"warning: {len(result.skipped_keys)} undecodable image(s) left out: "
                     f"{named(result.skipped_keys)}{more}")
    lines += [entry.warning() for entry in result.lost]
    return lines


def check_outputs(output: Path | None, json_path: Path | None) -> None:
    """Before any work: an unwritable --output or --json must not be found after the whole evaluation."""
    if output is not None:
        check_output_folder(output, "--output")
    if json_path is not None:
        check_output_file(json_path, "--json")


def save_settings(output: Path | None, config: Any, inputs: dict[str, Any], log: Callable[[str], None]) -> None:
    """Print the job's settings with its `inputs`, and keep them as config.yaml in `output` (when given)."""
    text = settings_text(config, extra={"inputs": inputs}, version=package_version())
    log(text.rstrip())
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(output / SETTINGS_FILE, text.encode())


def write_json(record: dict[str, Any], *places: tuple[Path | None, str]) -> None:
    """`record` as indented JSON at each (path, its option) that has a path; a failed write names the option."""
    for path, option in places:
        if path is not None:
            with writing(path, option):  # the disk may have filled during the work
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())

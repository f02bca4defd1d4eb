"""The pretraining job's configuration: one frozen, typed dataclass tree built by `jobs.config` (defaults,
a preset in `pretrain/presets/` or a YAML file, `--set` overrides). Values that depend on the run (world
size, data-set size) are derived once by `derive()` and printed next to the config at start."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal

from relicv2.jobs.config import ConfigError, Presets, resolve, settings_text
from relicv2.models.architecture import STAGE_BLOCKS, WIDTHS
from relicv2.pretrain.schedules import peak_learning_rate
from relicv2.pretrain.views.config import IMAGE_SIZE, ViewConfig


@dataclass(frozen=True)
class ModelConfig:
    depth: int = 50  # ResNet depth: 18, 34, 50, 101, 152 or 200
    width: int = 1  # width multiplier (1, 2 or 4), every layer widened
    hidden_dim: int = 4096  # projector / predictor hidden size
    out_dim: int = 256  # projector / predictor output size
    zero_init_residual: bool = False  # zero-init the last BN of each residual block
    sync_batchnorm: bool | None = None  # None: on when world_size > 1 (BN statistics over the global batch)
    activation_checkpointing: bool = False  # recompute encoder activations in backward (less memory, ~30% slower)


@dataclass(frozen=True)
class DataConfig:
    source: Literal["shards", "synthetic"] = "shards"
    train_shards: str = ""  # masked shard set folder (data.source = shards)
    synthetic_images: int = 1024  # data.source = synthetic: size of the generated data set
    synthetic_classes: int = 10


@dataclass(frozen=True)
class LossConfig:
    temperature: float = 0.2  # tau
    num_negatives: int = 10  # n_e; >= global batch - 1 means every other image (deterministic)
    contrast_weight: float = 0.3  # the paper's "contrast scale"
    invariance_weight: float = 2.0  # beta, the paper's "invariance scale"


@dataclass(frozen=True)
class OptimConfig:
    global_batch: int = 4096  # images per step over all ranks
    epochs: int = 1000
    warmup_epochs: float = 10.0
    base_lr: float = 0.3  # peak lr = base_lr * global_batch / 256
    weight_decay: float = 1.5e-6
    momentum: float = 0.9
    trust_coefficient: float = 1e-3
    ema_base: float = 0.996  # gamma_base; cosine schedule to 1
    clip_grad_norm: float = 0.0  # 0: no clipping


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/relicv2"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    bf16: bool | None = None  # None: bf16 autocast on GPU, fp32 on CPU
    channels_last: bool | None = None  # None: on GPU only
    compile: bool | None = None  # torch.compile the networks; None: on for CUDA, off on CPU
    # torch.compile backend: inductor (generated kernels, the fast one); aot_eager traces the same
    # graphs without code generation (to tell a capture problem from an inductor one, and in CPU tests)
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    max_steps: int = 0  # stop after this many steps (schedules unchanged); 0: run the whole schedule
    on_nonfinite: Literal["stop", "skip"] = "stop"
    checkpoint_every: int = 1000  # steps
    keep_checkpoints: int = 3
    log_every: int = 10  # steps
    progress_bar: bool = True


@dataclass(frozen=True)
class KnnConfig:
    """The kNN monitor's shard sets and the kNN classifier's settings.

    The single owner of the kNN defaults: `pretrain.knn.classify.evaluate_knn` and `relicv2 eval knn`
    take theirs from here.
    """

    train_shards: str = ""  # labelled shard set used as the kNN bank ("" : no kNN monitor)
    val_shards: str = ""
    every_epochs: int = 10
    k: int = 20
    temperature: float = 0.07
    crop_size: int = IMAGE_SIZE
    resize_size: int = 0  # short side before the centre crop; 0: crop_size / 0.875 (256 for 224)
    batch_size: int = 256

    def __post_init__(self) -> None:
        # Checked here, not only in PretrainConfig: `relicv2 eval knn` builds this section alone.
        _check_ranges(self, ("every_epochs", "k", "temperature", "crop_size", "batch_size"), ("resize_size",))
        if bool(self.train_shards) != bool(self.val_shards):
            raise ConfigError("train_shards and val_shards must be given together (or neither)")


# Settings that must be positive / at least 0 / in [0, 1], by dotted name.
POSITIVE = ("model.width", "model.hidden_dim", "model.out_dim", "data.synthetic_images", "data.synthetic_classes",
            "loss.temperature", "loss.num_negatives", "optim.global_batch", "optim.epochs", "optim.base_lr",
            "run.checkpoint_every", "run.keep_checkpoints", "run.log_every")
NON_NEGATIVE = ("optim.warmup_epochs", "optim.weight_decay", "optim.clip_grad_norm", "loss.contrast_weight",
                "loss.invariance_weight", "run.max_steps")
FRACTIONS = ("optim.ema_base", "optim.momentum")


@dataclass(frozen=True)
class PretrainConfig:
    """Everything a pretraining run needs; sections mirror the YAML presets."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    views: ViewConfig = field(default_factory=ViewConfig)  # view counts, sizes, augmentations, p_m
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    knn: KnnConfig = field(default_factory=KnnConfig)

    def __post_init__(self) -> None:
        _check_ranges(self, POSITIVE, NON_NEGATIVE, FRACTIONS)
        if self.model.width not in WIDTHS:
            raise ConfigError(f"model.width must be 1, 2 or 4 (the widths of the paper), got {self.model.width}")
        if not self.run.output_dir.strip():
            raise ConfigError("run.output_dir is empty; set it to the run's folder (e.g. --output runs/my-run)")
        if self.model.depth not in STAGE_BLOCKS:
            raise ConfigError(f"model.depth must be one of {', '.join(map(str, STAGE_BLOCKS))}, got {self.model.depth}")
        if self.optim.warmup_epochs > self.optim.epochs:
            raise ConfigError(
                f"optim.warmup_epochs={self.optim.warmup_epochs} exceeds optim.epochs={self.optim.epochs}"
            )


@dataclass(frozen=True)
class DerivedValues:
    """Values computed once from the config and the run (printed and saved with the config)."""

    world_size: int
    per_rank_batch: int
    dataset_size: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    peak_lr: float  # pretrain.schedules.peak_learning_rate: the value the schedule reaches


def per_rank_batch(config: PretrainConfig, world_size: int) -> int:
    """optim.global_batch split over the ranks; an error when it does not divide evenly."""
    batch = config.optim.global_batch
    if batch % world_size:
        raise ConfigError(f"optim.global_batch={batch} is not divisible by the world size {world_size}; "
                          f"set optim.global_batch to a multiple of {world_size}")
    return batch // world_size


def trained_protocol(config: PretrainConfig) -> dict[str, Any]:
    """The kNN settings that fit an encoder pretrained with `config`: its run's own monitor's (so
    `relicv2 eval knn` reproduces the run's figure), else its large views' size."""
    if config.knn.train_shards:
        return {name: getattr(config.knn, name) for name in ("k", "temperature", "crop_size", "resize_size")}
    return {"crop_size": config.views.large_size, "resize_size": 0}


def derive(
    config: PretrainConfig, *, world_size: int, dataset_size: int, steps_per_epoch: int | None = None
) -> DerivedValues:
    """Per-rank batch, steps per epoch, total/warmup steps and peak lr, computed once per run. steps_per_epoch
    defaults to dataset_size // global_batch; a data source that drops more (per-rank remainders) passes its own."""
    batch = config.optim.global_batch
    rank_batch = per_rank_batch(config, world_size)
    if steps_per_epoch is None:
        steps_per_epoch = dataset_size // batch
    if steps_per_epoch <= 0:
        raise ConfigError(f"the data set has {dataset_size} images, fewer than one global batch of {batch}; "
                          "lower optim.global_batch or use more data")
    return DerivedValues(world_size=world_size, per_rank_batch=rank_batch, dataset_size=dataset_size,
                         steps_per_epoch=steps_per_epoch, total_steps=steps_per_epoch * config.optim.epochs,
                         warmup_steps=round(steps_per_epoch * config.optim.warmup_epochs),
                         peak_lr=peak_learning_rate(config.optim.base_lr, batch))


PRESETS = Presets(job="relicv2 pretrain", package="relicv2.pretrain")


def load_config(config: str | Path | None = None, overrides: Sequence[str] = ()) -> PretrainConfig:
    """Defaults <- preset NAME or YAML file (if given) <- `section.key=value` overrides, type-checked."""
    return resolve(PretrainConfig, config, overrides, PRESETS)


def describe(config: PretrainConfig, derived: DerivedValues | None = None, version: str = "") -> str:
    """The resolved config (and derived values) as printed at start and saved to config.yaml."""
    return settings_text(config, extra={"derived": derived} if derived is not None else None, version=version)


def _check_ranges(config: Any, positive: Sequence[str], non_negative: Sequence[str] = (),
                  fractions: Sequence[str] = ()) -> None:
    """ConfigError naming the first setting (a dotted name) outside its range, or a float that is no number."""
    _validate_finite(config)
    for keys, fits, rule in ((positive, lambda v: v > 0, "be positive"), (non_negative, lambda v: v >= 0, "be >= 0"),
                             (fractions, lambda v: 0.0 <= v <= 1.0, "lie in [0, 1]")):
        for key in keys:
            if not fits(value := attrgetter(key)(config)):
                raise ConfigError(f"{key} must {rule}, got {value}")


def _validate_finite(config: Any, prefix: str = "") -> None:
    """Every float in the tree is a number: NaN or infinity is never a usable setting."""
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            _validate_finite(value, f"{prefix}{item.name}.")
            continue
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{prefix}{item.name} must be a finite number, got {value}")

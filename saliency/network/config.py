"""Configuration of `relicv2 saliency train` and `relicv2 saliency build-masks` through `jobs.config`:
train's defaults are the paper's values (docs/design.md "Refinement (DeepUSPS-style)"), presets in
`saliency/presets/NAME.yaml` and `saliency/presets/build-masks/NAME.yaml`, `--set k=v`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relicv2.jobs.config import ConfigError, Presets, is_file_reference, resolve
from relicv2.jobs.workers import rank_cores, usable_cores
from relicv2.saliency.handcrafted import METHOD_NAMES

MAX_INPUT_SIZE = 4096  # px: the network's square input (the paper's 432); one larger image alone needs GBs

# First-iteration binarisation thresholds of the handcrafted maps (maps in [0, 1]). MC, DSR and
# RBD: the DeepUSPS reference values. DeepUSPS used HS (0.36) where ReLICv2 and we use MR; MR's
# maps are a ranking score whose second stage already thresholds at the map mean, so its
# foreground is bright and its background spread low. 0.33 gives MR the same median foreground
# fraction on the PASCAL-S dev images as the other three methods at their thresholds (measured on
# images 0001-0240).
DEFAULT_THRESHOLDS = {"mc": 0.31, "dsr": 0.23, "rbd": 0.25, "mr": 0.33}


@dataclass(frozen=True)
class CrfConfig:
    """Dense CRF on the resized RGB image (DeepUSPS's values, also in docs/design.md)."""

    gaussian_sxy: float = 3.0
    gaussian_compat: float = 3.0
    bilateral_sxy: float = 80.0
    bilateral_srgb: float = 13.0
    bilateral_compat: float = 10.0
    iterations: int = 5
    # The spatial widths above are in pixels of DeepUSPS's 432 px input. At another input size they
    # are scaled by input_size / 432 so that the CRF sees the same neighbourhoods of the object (at
    # 64 px an unscaled bilateral sxy of 80 would span the whole image and pull every pixel of a
    # similar colour together).
    reference_size: int = 432

    def __post_init__(self) -> None:
        for name in ("gaussian_sxy", "bilateral_sxy", "bilateral_srgb", "reference_size"):
            if not getattr(self, name) > 0:  # widths: a Gaussian of no or negative width is none
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("gaussian_compat", "bilateral_compat", "iterations"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def at_size(self, size: int) -> CrfConfig:
        """These settings with the spatial widths scaled to a `size` x `size` input."""
        scale = size / self.reference_size
        return dataclasses.replace(self, gaussian_sxy=self.gaussian_sxy * scale,
                                   bilateral_sxy=self.bilateral_sxy * scale, reference_size=size)


@dataclass(frozen=True)
class SaliencyTrainConfig:
    """One `relicv2 saliency train` job (paper values by default)."""

    preset: str = "paper"  # where the settings came from: a preset's name or a YAML file's stem
    depth: int = 50  # encoder ResNet depth
    width: int = 1  # encoder width multiplier (2 for SwAV's ResNet-50 2x, as the paper)
    input_size: int = 432  # images resized to input_size x input_size (bicubic; labels nearest)
    num_images: int = 2500  # images sampled from the shard set (seeded)
    methods: tuple[str, ...] = METHOD_NAMES  # the handcrafted methods refinement learns from: all by default
    iterations: int = 3  # K self-supervised iterations per method (phase I; 0: none, phase II fits the maps)
    epochs: int = 25  # E epochs per iteration
    batch_size: int = 10
    lr: float = 1e-5  # phase I, first iteration; doubles each iteration
    lr_growth: float = 2.0
    average_keep: float = 0.7  # moving average of CRF-refined predictions: 0.7 old + 0.3 new
    phase1_beta2: float = 1.0  # F-measure beta^2 of the loss in phase I (docs/design.md)
    fuse_epochs: int = 200  # phase II
    # Phase II lr: the paper's 1e-5 (DeepUSPS's code uses 1e-4). We follow the paper, since the
    # encoder starts from self-supervised weights that a 10x larger step would wash out.
    fuse_lr: float = 1e-5
    fuse_beta2: float = 4.0
    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    crf: CrfConfig = field(default_factory=CrfConfig)
    seed: int = 0
    workers: int = 2  # processes for handcrafted maps and the CRF
    device: str = "auto"  # "auto": CUDA when a GPU is visible, else the CPU; or "cpu", "cuda[:N]"
    threads: int = 0  # torch intra-op threads (0: torch's default)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ConfigError(f"methods {list(self.methods)} must be a non-empty subset of {METHOD_NAMES}")
        missing = [m for m in self.methods if m not in self.thresholds]
        if missing:
            raise ConfigError(f"no first-iteration threshold for {missing}; set thresholds.<method>=VALUE")
        for name in ("input_size", "num_images", "epochs", "batch_size", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.iterations < 0:
            raise ConfigError(f"iterations must be >= 0 (0: the fused network on the handcrafted labels), "
                              f"got {self.iterations}")
        if (problem := input_size_problem(self.input_size)) is not None:
            raise ConfigError(problem)
        if self.fuse_epochs < 0:
            raise ConfigError(f"fuse_epochs must be >= 0, got {self.fuse_epochs}")
        if not 0.0 <= self.average_keep < 1.0:
            raise ConfigError(f"average_keep must be in [0, 1), got {self.average_keep}")


def input_size_problem(size: Any) -> str | None:
    """Why `size` is no input size of the saliency network (a whole multiple of 8, the output stride, up to
    MAX_INPUT_SIZE), or None."""
    if type(size) is not int or not 8 <= size <= MAX_INPUT_SIZE or size % 8:
        return f"input_size must be a multiple of 8 (output stride) from 8 to {MAX_INPUT_SIZE}, got {size!r:.20}"
    return None


PRESETS = Presets(job="relicv2 saliency train", package="relicv2.saliency")


def load_saliency_config(config: str | Path | None = None, overrides: Sequence[str] = ()) -> SaliencyTrainConfig:
    """Defaults (the paper's) <- preset NAME or YAML file (flat keys, `crf:` a section) <- `key=value`;
    `preset` records the preset's name or the file's stem."""
    label = None if config is None else (Path(config).stem if is_file_reference(config) else str(config))
    return resolve(SaliencyTrainConfig, config, overrides, PRESETS,
                   defaults={"preset": label} if label else None)


class MasksError(ValueError):
    """A build-masks input, output folder or machine the job cannot use, or a job that could not go on."""


@dataclass(frozen=True)
class BuildMasksConfig:
    """One `relicv2 saliency build-masks` job (`load_masks_config`: from a preset, the options and `--set`)."""

    model: Path
    shards: Path
    out: Path
    workers: int | None = None  # processes; None: default_workers(); 0: all in the job's own process
    batch_size: int = 32
    device: str = "auto"  # CUDA when a GPU is visible (this rank's under torchrun), else the CPU
    progress: bool = True
    merge_timeout_s: float = 3600.0  # rank 0 waits this long for the other ranks' shards
    # Average each mask with the prediction of the mirrored image, mirrored back: twice the forward, a small
    # max-F gain on held-back PASCAL-S (benchmarks/RESULTS.md, "Levers: what each bought").
    flip: bool = False
    # Refine each mask with the dense CRF the model was trained with, at its input size, in the workers: CPU
    # time an image, and on held-back PASCAL-S a lower MAE and a higher max-F for every one-round model
    # measured (benchmarks/RESULTS.md, "Dense CRF cost" and "CRF at inference").
    crf: bool = False
    # Where indexes of input tars without one are derived; None: shards.shardset.default_index_cache.
    index_cache: Path | None = None
    # A rerun hashes every finished masked tar and rebuilds those whose bytes changed (bit rot); without, it
    # reads none (shards.driver.run_shard_job).
    rehash_shards: bool = False


MASKS_PRESETS = Presets(job="relicv2 saliency build-masks", package="relicv2.saliency", folder="presets/build-masks")


def load_masks_config(config: str | Path | None = None, overrides: Sequence[str] = (), **given: Any) -> BuildMasksConfig:
    """Defaults <- preset NAME or YAML file <- the command's options in `given` (None: not given) <- `key=value`."""
    return resolve(BuildMasksConfig, config, overrides, MASKS_PRESETS,
                   given={key: value for key, value in given.items() if value is not None})


def default_workers() -> int:
    """Worker processes when --workers is not given: this rank's share of the cores, less one for the
    job's own process (reading, the network, tar writing)."""
    return max(1, rank_cores() - 1)


def job_workers(config: BuildMasksConfig) -> tuple[int, str | None]:
    """(worker processes, a note when --workers was lowered); MasksError for a batch under 1. More
    workers than the usable cores, or than the tasks in flight at once (a batch being prepared and
    one being finished, each cut in at most a batch's worth of chunks), would only wait."""
    if config.batch_size < 1:
        raise MasksError(f"--batch {config.batch_size}: a batch holds at least 1 image")
    if config.workers is None:
        return default_workers(), None
    limit = max(1, min(usable_cores(), 2 * config.batch_size))
    if config.workers <= limit:
        return config.workers, None
    return limit, (f"--workers {config.workers} lowered to {limit}: more than {usable_cores()} usable cores or "
                   f"2 x --batch {config.batch_size} tasks at once would only wait")

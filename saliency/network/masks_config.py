"""The settings of `relicv2 saliency build-masks`: its config, presets and worker processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relicv2.jobs.config import Presets, resolve
from relicv2.jobs.workers import rank_cores, usable_cores


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
    # max-F gain on held-back PASCAL-S (benchmarks/RESULTS.md, "Levers at small scale").
    flip: bool = False
    # Refine each mask with the dense CRF the model was trained with, at its input size, in the workers: CPU
    # time an image, and on held-back PASCAL-S a lower MAE and a higher max-F for every one-round model
    # measured (benchmarks/RESULTS.md, "Dense CRF cost" and "CRF at inference").
    crf: bool = False
    # Where indexes of input tars without one are derived; None: shards.shardset.default_index_cache.
    index_cache: Path | None = None


PRESETS = Presets(job="relicv2 saliency build-masks", package="relicv2.saliency", folder="presets/build-masks")


def load_masks_config(config: str | Path | None = None, overrides: Sequence[str] = (), **given: Any) -> BuildMasksConfig:
    """Defaults <- preset NAME or YAML file <- the command's options in `given` (None: not given) <- `key=value`."""
    return resolve(BuildMasksConfig, config, overrides, PRESETS,
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

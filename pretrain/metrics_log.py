"""Rank-0 metrics output: JSONL file, TensorBoard scalars and the run's progress (jobs.progress), and the
throughput window every rank measures between records."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.progress import Phase

METRICS_NAME = "metrics.jsonl"
# Shown in the progress bar, in this order (the JSONL and TensorBoard get every metric).
BAR_FIELDS = ("loss", "contrastive", "invariance", "lr", "ema", "images_per_s", "data_wait_s", "knn_top1")


def truncate_metrics(output_dir: str | Path, step: int) -> int:
    """Drop the records after global step `step` (and a torn last line) from `metrics.jsonl`, atomically;
    returns how many. On a resume from the checkpoint of `step` the steps a killed run logged after it are
    trained again: their old records would appear twice."""
    path = Path(output_dir) / METRICS_NAME
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):  # a torn or foreign line is dropped
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
    if len(kept) < len(lines):
        atomic_write_bytes(path, "".join(f"{line}\n" for line in kept).encode())
    return len(lines) - len(kept)


class MetricsLogger:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors it to TensorBoard. Create it on
    rank 0 only. On resume it appends, so the file holds the whole run; call `truncate_metrics` first so the
    steps after the checkpoint are not logged twice."""

    def __init__(self, output_dir: str | Path, *, total_steps: int, initial_step: int, progress_bar: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.output_dir / METRICS_NAME, "a", encoding="utf-8")  # noqa: SIM115
        self._tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=initial_step)
        # On a terminal a redrawn bar; in a log file (SLURM, CI, nohup) one plain line a minute and at the end.
        self._progress = Phase("pretrain", total_steps, unit="step", enabled=progress_bar, initial=initial_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in metrics.items():
            if isinstance(value, int | float):
                self._tensorboard.add_scalar(f"pretrain/{name}", value, step)
        self._progress.set_postfix(**{k: metrics[k] for k in BAR_FIELDS if k in metrics})

    def advance(self, steps: int = 1) -> None:
        self._progress.update(steps)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        self._progress.write(text)

    def close(self) -> None:
        self._progress.close()
        self._tensorboard.close()
        self._jsonl.close()


class Window:
    """Throughput, data-wait time and the masking applied over the steps since the last log record."""

    def __init__(self) -> None:
        self.start, self.steps, self.data_wait = time.perf_counter(), 0, 0.0
        self.masked, self.large_views = 0, 0  # on this rank's share of the data

    def timed(self, batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Iterate `batches`, adding the time spent waiting for each batch to the window."""
        batches = iter(batches)
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                return
            self.data_wait += time.perf_counter() - waited
            if "masking" in batch:  # shards: how many large views the loader masked
                self.masked, self.large_views = self.masked + batch["masking"][0], self.large_views + batch["masking"][1]
            yield batch

    def take(self, global_batch: int) -> dict[str, float]:
        """images_per_s, the mean data_wait_s per step and (from shards) the masked_fraction of the large
        views over the window, then start a new window."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        record = {"images_per_s": global_batch * self.steps / elapsed,
                  "data_wait_s": self.data_wait / max(self.steps, 1)}
        if self.large_views:
            record["masked_fraction"] = self.masked / self.large_views
        self.__init__()  # the next window starts now
        return record

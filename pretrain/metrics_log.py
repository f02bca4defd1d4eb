"""Rank-0 metrics output: JSONL file, TensorBoard scalars and a tqdm progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jobs.atomic import atomic_write_bytes

METRICS_NAME = "metrics.jsonl"
# Shown in the progress bar, in this order (the JSONL and TensorBoard get every metric).
LINE_EVERY_S = 60.0  # progress lines in a log file (not a terminal)
BAR_FIELDS = ("loss", "contrastive", "invariance", "lr", "ema", "images_per_s", "data_wait_s", "knn_top1")


def truncate_metrics(output_dir: str | Path, step: int) -> int:
    """Drop the records after global step `step` from `metrics.jsonl` (atomically); returns how many.

    Called when a run resumes from the checkpoint of `step`: the steps a killed run logged after
    that checkpoint are trained again, so their old records would appear twice. A torn last line
    (the kill hit a write) is dropped too.
    """
    path = Path(output_dir) / METRICS_NAME
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = int(record["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_bytes(path, "".join(f"{line}\n" for line in kept).encode())
    return dropped


class MetricsLogger:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors it to TensorBoard.

    Create it on rank 0 only. On resume it appends, so the file holds the whole run; call
    `truncate_metrics` first so the steps after the checkpoint are not logged twice.
    """

    def __init__(self, output_dir: str | Path, *, total_steps: int, initial_step: int, progress_bar: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.output_dir / METRICS_NAME, "a", encoding="utf-8")  # noqa: SIM115
        self._tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=initial_step)
        # On a terminal a redrawn bar; in a log file (SLURM, CI, nohup) one plain line every
        # LINE_EVERY_S seconds and at the end, with step, rate, ETA and the loss.
        self._interactive = progress_bar and sys.stderr.isatty()
        self._lines = progress_bar and not self._interactive
        self._bar = tqdm(total=total_steps, initial=initial_step, desc="pretrain", unit="step",
                         dynamic_ncols=True, disable=not self._interactive)
        self._step, self._total, self._first_step = initial_step, total_steps, initial_step
        self._start = self._last_line = time.monotonic()
        self._shown: dict[str, str] = {}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` (numbers) for global step `step`."""
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in metrics.items():
            if isinstance(value, int | float):
                self._tensorboard.add_scalar(f"pretrain/{name}", value, step)
        self._shown = {k: _short(metrics[k]) for k in BAR_FIELDS if k in metrics}
        self._bar.set_postfix(self._shown, refresh=False)

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)
        self._step += steps
        now = time.monotonic()
        if self._lines and (now - self._last_line >= LINE_EVERY_S or self._step >= self._total):
            self._last_line = now
            print(self._progress_line(now), file=sys.stderr, flush=True)

    def _progress_line(self, now: float) -> str:
        done = self._step - self._first_step
        per_step = (now - self._start) / done if done else 0.0
        eta = per_step * (self._total - self._step)
        shown = ", ".join(f"{k} {v}" for k, v in self._shown.items())
        return (f"pretrain: step {self._step}/{self._total} ({100 * self._step / max(self._total, 1):.0f}%), "
                f"{per_step:.2f} s/step, ETA {_clock(eta)}" + (f", {shown}" if shown else ""))

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()
        self._tensorboard.close()
        self._jsonl.close()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

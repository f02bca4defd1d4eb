"""Stopping a pretraining run on SIGTERM (pre-emption) or SIGINT (Ctrl-C): the step loop checkpoints the
current step, then stops, on every rank at the same step."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

import torch

from relicv2.pretrain.distributed import DistributedContext, all_reduce_mean


class PretrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT arrived; a checkpoint of the current step was saved, the run stopped."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint {checkpoint} saved, "
                         "run the same command again to continue")


class StopSignals:
    """SIGTERM (pre-emption) and SIGINT (Ctrl-C) ask the loop to checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # signals can only be handled in the main thread
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the checkpoint
        self.received = signal.Signals(signum).name

    def agreed(self, ctx: DistributedContext) -> str | None:
        """The signal name when any rank received one (every rank learns it at the same step)."""
        if not ctx.is_distributed:
            return self.received
        flags = torch.tensor([self.received == "SIGTERM", self.received == "SIGINT"], dtype=torch.float32,
                             device=ctx.device)
        term, interrupt = all_reduce_mean(flags, ctx).tolist()  # one tiny collective per step
        return "SIGTERM" if term > 0 else ("SIGINT" if interrupt > 0 else None)

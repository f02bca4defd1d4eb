"""One torch intra-op thread for the duration of a block (tests on a shared 2-core box).

Tiny networks gain nothing from threads, and on a busy CPU torch's OpenMP threads spin-wait for
descheduled cores at every barrier (measured 10-30x slower); the setting is restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

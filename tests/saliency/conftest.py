"""The saliency tests run single-threaded, as the batch job does (see jobs.workers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relicv2.jobs.workers import single_threaded


@pytest.fixture(scope="package", autouse=True)
def _one_thread() -> Iterator[None]:
    # Small matrices: threads only add overhead, and oversubscribe a busy machine.
    with single_threaded():
        yield

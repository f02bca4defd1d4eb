"""Shared test fixtures. Real images live in ../shared/data beside the repository (absent in a user's clone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One OpenMP thread in every test process and every process a test starts (set before anything imports torch;
# an explicit setting wins): xdist already runs a process per core, and on more threads than cores torch's
# OpenMP threads spin-wait at every barrier for descheduled ones (the suite spent ~12% more CPU so).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.e2e.background_demo import DEMO, DEMO_TESTS
from tests.paths import SHARED_DATA
from tests.rank_pair import RankPair
from tests.threads import one_torch_thread


@pytest.fixture(scope="session", autouse=True)
def index_cache(tmp_path_factory: pytest.TempPathFactory):
    """Indexes derived for plain WebDataset sets go to a folder of the test session, never the user's
    ~/.cache (tests that need their own folder set RELICV2_INDEX_CACHE themselves)."""
    from relicv2.shards.shardset import INDEX_CACHE_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(INDEX_CACHE_ENV, str(tmp_path_factory.mktemp("index-cache")))
        yield


@pytest.fixture(scope="session")
def rank_pair():
    """Two rank processes that the 2-rank tests of this process share (`tests.rank_pair`)."""
    pair = RankPair()
    yield pair
    pair.close()


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test (see `tests.threads`); use with `usefixtures`."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared real-image folder; tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (only present beside the team's checkouts)")
    return SHARED_DATA


def _xdist_worker() -> bool:
    """True in a pytest-xdist worker (`make test` runs the suite on every core)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available (``pytest -m gpu`` on the GPU machine).
    In one process the reduced-demo tests run last (their demo runs in the background meanwhile).
    Under xdist they run first, so that the worker that takes them runs the demo while the others go on,
    then the modules that hold a test marked ``slow``, whole (a module fixture is made once): worksteal
    hands each worker a contiguous half of this order and an idle worker takes tests from the end of a
    busy one's queue, so the long tests start early and the run ends on short ones, not with one worker
    alone on a long test."""
    import torch

    if _xdist_worker():
        slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: (not item.nodeid.startswith(DEMO_TESTS), item.path not in slow))
    else:
        items.sort(key=lambda item: item.nodeid.startswith(DEMO_TESTS))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the reduced demo in the background when a test of it is going to run (in one process;
    an xdist worker starts it when it gets the first demo test: every worker collects every test)."""
    if _xdist_worker():
        return
    if not session.config.option.collectonly and any(item.nodeid.startswith(DEMO_TESTS) for item in session.items):
        DEMO.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    DEMO.stop()

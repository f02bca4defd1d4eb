"""Batches made ahead in a background thread (`views.ready_batches`): same stream, exact checkpoints,
work done while the consumer is busy, errors that reach the consumer, a thread that stops with its loader."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from relicv2.pretrain.views.config import ViewConfig, ready_batches
from relicv2.pretrain.views.loader import ViewLoader
from relicv2.pretrain.views.reference import ReferenceBackend
from tests.pretrain.views.test_loader import TINY, plain_set


def _wait_for(condition, timeout_s: float = 20.0) -> bool:
    """Poll `condition` until it holds (the thread works at its own pace); False after the timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def _counted(monkeypatch) -> list[int]:
    """Counts the batches made by reference backends built from now on (in whichever thread makes
    them); threads of earlier tests' loaders may still be running and are not counted."""
    calls: list[int] = []
    built: set[int] = set()
    original_init, original_next = ReferenceBackend.__init__, ReferenceBackend.next_batch

    def init(self, setup):
        built.add(id(self))
        original_init(self, setup)

    def next_batch(self):
        if id(self) in built:
            calls.append(1)
        return original_next(self)

    monkeypatch.setattr(ReferenceBackend, "__init__", init)
    monkeypatch.setattr(ReferenceBackend, "next_batch", next_batch)
    return calls


@pytest.fixture(scope="module")
def ten(tmp_path_factory):
    return plain_set(tmp_path_factory.mktemp("ten"), 10)  # batch 4: 2 batches an epoch, 2 samples dropped


@pytest.mark.parametrize("backend", ["dali", "reference"])
def test_batches_made_ahead_are_the_batches_made_on_demand_with_the_same_checkpoints(ten, backend):
    def stream(ready: int) -> list[tuple[list[str], list[torch.Tensor], dict]]:
        loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=ready), seed=4, backend=backend)
        out = []
        for _ in range(3):  # three epochs: the thread runs on across two boundaries
            out += [(b["keys"], b["views"], loader.state_dict()) for b in loader]
            out.append(([], [], loader.state_dict()))  # the position after the epoch's end
        return out

    on_demand, made_ahead = stream(0), stream(2)
    assert len(on_demand) == len(made_ahead) == 9
    for (keys_a, views_a, state_a), (keys_b, views_b, state_b) in zip(on_demand, made_ahead, strict=True):
        assert keys_a == keys_b
        assert all(torch.equal(a, b) for a, b in zip(views_a, views_b, strict=True))
        # A checkpoint taken while the thread is ahead describes the batch delivered, not the last one made.
        assert state_a == state_b


@pytest.mark.parametrize("backend", ["dali", "reference"])
def test_resuming_a_loader_whose_thread_is_ahead_continues_after_the_delivered_batch(ten, backend):
    loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=2), seed=6, backend=backend)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    expected = [next(batches)["keys"]]  # the rest of epoch 0
    assert list(loader) == []  # its end
    expected += [b["keys"] for b in loader]  # epoch 1
    batches.close()
    loader.load_state_dict(state)  # the same loader: its thread (already ahead) is stopped and restarted
    assert [b["keys"] for b in loader] + [b["keys"] for b in loader] == expected


def test_the_thread_makes_the_next_epochs_batches_while_the_consumer_is_busy(ten, monkeypatch):
    calls = _counted(monkeypatch)
    loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=1), seed=1, backend="reference")
    assert len(list(loader)) == 2  # epoch 0; the consumer now "trains" and asks for nothing
    # The thread crosses the epoch's end: the next epoch's first batch waits in the queue and the
    # second is made and held, and no more (the queue is bounded).
    assert _wait_for(lambda: len(calls) == 4)
    time.sleep(0.3)
    assert len(calls) == 4
    assert len(list(loader)) == 2


def test_without_ready_batches_nothing_is_made_before_it_is_asked_for(ten, monkeypatch):
    calls = _counted(monkeypatch)
    loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=0), seed=1, backend="reference")
    assert len(list(loader)) == 2
    time.sleep(0.3)
    assert len(calls) == 2


@pytest.mark.parametrize("ready", [0, 2])
def test_an_error_reaches_the_consumer_after_the_batches_made_before_it_and_again_later(ten, monkeypatch, ready):
    calls = _counted(monkeypatch)
    original = ReferenceBackend.next_batch

    def failing(self):
        if len(calls) == 2:
            raise ValueError("a bug in the backend")
        return original(self)

    monkeypatch.setattr(ReferenceBackend, "next_batch", failing)
    loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=ready), seed=1, backend="reference")
    assert len(list(loader)) == 2  # the batches made before the failure are delivered
    state = loader.state_dict()
    for _ in range(2):  # raised as itself, and again on a later try rather than a hang
        with pytest.raises(ValueError, match="a bug in the backend"):
            next(iter(loader))
    assert loader.state_dict() == state  # the position stays at the last batch delivered


def test_dropping_the_loader_stops_its_thread(ten):
    before = set(threading.enumerate())
    loader = ViewLoader(ten, 4, ViewConfig(**TINY, ready_batches=1), seed=1, backend="reference")
    next(iter(loader))
    started = [t for t in set(threading.enumerate()) - before if t.name == "relicv2-views-ahead"]
    assert len(started) == 1 and started[0].is_alive()
    del loader
    gc.collect()
    assert _wait_for(lambda: not started[0].is_alive())


def test_ready_batches_are_one_on_a_gpu_and_none_on_a_cpu_unless_set(ten):
    # On a CPU the trainer's threads use every core: a thread making batches meanwhile only competes
    # (benchmarks/RESULTS.md); on a GPU the cores are free while the GPU steps.
    assert ready_batches(ViewConfig(), "cuda:1") == 1 and ready_batches(ViewConfig(), "cpu") == 0
    assert ready_batches(ViewConfig(ready_batches=3), "cpu") == 3
    assert ViewLoader(ten, 4, ViewConfig(**TINY), backend="reference").config.ready_batches == 0
    with pytest.raises(ValueError, match="ready_batches must be >= 0"):
        ViewConfig(ready_batches=-1)

"""The dense CRF snaps a vague foreground probability to the object's edges."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import cv2
import numpy as np
import pytest

from relicv2.saliency.network.config import CrfConfig
from relicv2.saliency.network.crf import CrfPool, dense_crf
from tests.scenes import synthetic_scene


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max((a | b).sum(), 1))


def test_crf_moves_a_blurred_shifted_guess_towards_the_object() -> None:
    rgb, mask = synthetic_scene(64, 64, seed=3)
    truth = mask > 0
    guess = cv2.GaussianBlur(np.roll(truth.astype(np.float32), (4, 4), axis=(0, 1)), (0, 0), 4.0) * 0.8 + 0.1
    refined = dense_crf(rgb, guess, CrfConfig().at_size(64))
    assert refined.shape == (64, 64) and refined.min() >= 0 and refined.max() <= 1
    assert _iou(refined >= 0.5, truth) > _iou(guess >= 0.5, truth) + 0.05


def test_crf_widths_scale_with_the_input_size() -> None:
    scaled = CrfConfig().at_size(216)
    assert scaled.bilateral_sxy == pytest.approx(40.0) and scaled.gaussian_sxy == pytest.approx(1.5)
    assert scaled.bilateral_srgb == 13.0 and scaled.bilateral_compat == 10.0
    with pytest.raises(ValueError, match="differ in size"):
        dense_crf(np.zeros((8, 8, 3), np.uint8), np.zeros((8, 9), np.float32), CrfConfig())


def test_the_crf_pool_matches_one_process_and_its_workers_load_no_torch() -> None:
    # A spawned worker imports the module of the functions it runs: with torch and the network, several
    # times the CPU and memory before its first image (RESULTS.md, "Dense CRF cost").
    scenes = [synthetic_scene(32, 32, seed=i) for i in range(4)]
    images = np.stack([rgb for rgb, _ in scenes])
    guesses = np.stack([cv2.GaussianBlur(mask.astype(np.float32) / 255.0, (0, 0), 3.0) for _, mask in scenes])
    config = CrfConfig().at_size(32)
    pool = CrfPool(images, config, workers=2)
    try:
        refined = pool.submit(guesses).result()
        workers = list(pool.pool._processes)  # the executor's worker pids
        mapped = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in workers}
    finally:
        pool.close()
    assert len(workers) == 2 and not [pid for pid, maps in mapped.items() if "libtorch" in maps]
    alone = CrfPool(images, config, workers=1)  # in this process
    assert np.array_equal(refined, alone.submit(guesses).result())


def test_a_dead_crf_worker_ends_the_wait_with_the_pools_error() -> None:
    """Not a hang: the error the `relicv2` command turns into one line (`tests/jobs/test_workers.py`)."""
    scenes = [synthetic_scene(32, 32, seed=i) for i in range(4)]
    images = np.stack([rgb for rgb, _ in scenes])
    guesses = np.stack([mask.astype(np.float32) / 255.0 for _, mask in scenes])
    with CrfPool(images, CrfConfig().at_size(32), workers=2) as pool:
        pool.submit(guesses).result()  # the workers are up
        os.kill(next(iter(pool.pool._processes)), signal.SIGKILL)  # killed by the system, say
        deadline = time.monotonic() + 30
        with pytest.raises(BrokenProcessPool):
            while time.monotonic() < deadline:  # the pool notices the death within moments
                pool.submit(guesses).result()

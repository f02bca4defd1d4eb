"""`MaskPredictor`: probabilities written into the job's ring (`out`) equal the ones it returns alone, on the
CPU and, page-locked for DMA, on a GPU; a job reports whether its ring was page-locked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks
from relicv2.saliency.network.mask_work import SlotRing
from relicv2.saliency.network.predictor import MaskPredictor, launch_forward
from relicv2.shards.build import Ranks
from tests.saliency.network.conftest import SquarePredictor


def _squares(count: int, size: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def test_probabilities_written_into_out_equal_the_returned_ones_on_the_cpu(tiny_model) -> None:
    predictor = MaskPredictor(tiny_model, "cpu")
    squares = _squares(3, predictor.size)
    alone = predictor(squares)
    out = np.full((3, predictor.size, predictor.size), -1.0, np.float32)
    assert predictor.launch(squares, out)() is out
    assert np.array_equal(out, alone) and 0 <= out.min() and out.max() <= 1
    assert predictor.register_host_memory(out.ctypes.data, out.nbytes) is False  # nothing to page-lock on a CPU


def test_launch_forward_fills_out_from_a_plain_callable() -> None:
    out = np.zeros((2, 32, 32), np.float32)
    launch_forward(SquarePredictor(), _squares(2, 32), out)()
    assert np.array_equal(out, SquarePredictor()(np.zeros((2, 32, 32, 3), np.uint8)))


def test_a_cpu_job_reports_its_ring_not_page_locked(tmp_path, scene_shards, tiny_model) -> None:
    config = BuildMasksConfig(model=tiny_model, shards=scene_shards[0], out=tmp_path / "out", workers=0,
                              batch_size=4, progress=False)
    summary = build_masks(config, Ranks())
    assert summary["written"] == 12 and summary["ring_page_locked"] is False


@pytest.mark.gpu
def test_page_locked_ring_gives_the_pinned_copies_results_on_the_gpu(tiny_model) -> None:
    predictor = MaskPredictor(tiny_model, "cuda")
    ring = SlotRing.create(batch=4, size=predictor.size)
    try:
        assert predictor.register_host_memory(*ring.address())
        ring.squares(1)[:] = _squares(4, predictor.size)
        copied = predictor(ring.squares(1).copy())  # not in the ring: pinned copies both ways
        out = ring.probabilities(1)
        out[...] = -1.0  # a map the DMA did not land in stays at -1
        torch.cuda.set_sync_debug_mode("error")  # neither DMA may make the host wait for the GPU
        try:
            wait = predictor.launch(ring.squares(1), out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert wait() is out
        # Same kernels on the same input; the tolerance only allows for a convolution algorithm chosen anew.
        np.testing.assert_allclose(out, copied, atol=1e-2)
    finally:
        predictor.unregister_host_memory()
        ring.release()


@pytest.mark.gpu
def test_a_gpu_job_page_locks_its_ring(tmp_path, scene_shards, tiny_model) -> None:
    config = BuildMasksConfig(model=tiny_model, shards=scene_shards[0], out=tmp_path / "out", workers=1,
                              batch_size=4, device="cuda", progress=False)
    summary = build_masks(config, Ranks())
    assert summary["written"] == 12 and summary["ring_page_locked"] is True

"""Dense CRF refinement of a foreground probability map (Kraehenbuehl & Koltun 2011).

Uses `pydensecrf2` (a maintained, source-built wrapper of the authors' permutohedral-lattice C++
code, imported as `pydensecrf`): exact to what DeepUSPS ran, ~20 ms per 112x112 image on one core.
It needs a C++ compiler at install time (the set-up and the Docker image have one). Two labels (background,
foreground), unary -log p, the pairwise terms of `config.CrfConfig`, on the resized RGB image as in DeepUSPS.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from relicv2.jobs.config import build
from relicv2.jobs.workers import worker_pool

# Workers import this module (build-masks' and `CrfPool`'s), so it imports neither torch nor the network: with
# them a spawned worker's start cost several times the CPU and memory (RESULTS.md, "Dense CRF cost").
if TYPE_CHECKING:  # the config module pulls in every handcrafted method
    from relicv2.saliency.network.config import CrfConfig

PROBABILITY_FLOOR = 1e-5  # -log(0) would be an infinite unary


def dense_crf(rgb: np.ndarray, foreground: np.ndarray, config: CrfConfig) -> np.ndarray:
    """CRF-refined foreground probability [H, W] float32 of `rgb` uint8 [H, W, 3] and `foreground` [H, W]."""
    import pydensecrf.densecrf as dcrf

    height, width = foreground.shape
    if rgb.shape[:2] != (height, width):
        raise ValueError(f"image {rgb.shape[:2]} and probability map {foreground.shape} differ in size")
    p = np.clip(foreground.astype(np.float32), PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
    probabilities = np.stack([1.0 - p, p]).reshape(2, -1)
    crf = dcrf.DenseCRF2D(width, height, 2)
    crf.setUnaryEnergy(np.ascontiguousarray(-np.log(probabilities), dtype=np.float32))
    crf.addPairwiseGaussian(sxy=config.gaussian_sxy, compat=config.gaussian_compat)
    crf.addPairwiseBilateral(sxy=config.bilateral_sxy, srgb=config.bilateral_srgb,
                             rgbim=np.ascontiguousarray(rgb, dtype=np.uint8), compat=config.bilateral_compat)
    return np.asarray(crf.inference(config.iterations), dtype=np.float32).reshape(2, height, width)[1]


def model_crf(info: Mapping[str, Any], source: str) -> CrfConfig:
    """The CRF a saliency model was trained with (its file's `config.crf`; the defaults where the file
    records none), at the model's input size: what `--crf` applies to its predictions. ConfigError,
    naming `source`, for settings the file holds but no CrfConfig takes."""
    from relicv2.saliency.network.config import CrfConfig

    config = info.get("config")
    section = config.get("crf") if isinstance(config, Mapping) else None
    return build(CrfConfig, section or {}, source=source, prefix="crf.", saved=True).at_size(int(info["input_size"]))


_WORK: dict = {}  # a CRF worker's images and settings, sent to it once (`_init_crf_worker`)


def _init_crf_worker(images: np.ndarray, config: CrfConfig) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _WORK.update(images=images, config=config)


def _crf_chunk(indices: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
    images, config = _WORK["images"], _WORK["config"]
    return np.stack([dense_crf(images[i], p, config) for i, p in zip(indices, probabilities, strict=True)])


class Refinement:
    """The CRF-refined probabilities of one `CrfPool.submit`, computing in the pool meanwhile."""

    def __init__(self, futures: list | None = None, done: np.ndarray | None = None):
        self._futures, self._done = futures, done

    def result(self) -> np.ndarray:
        """The refined foreground probabilities [N, S, S], waiting for the workers."""
        if self._done is None:
            self._done = np.concatenate([f.result() for f in self._futures])
            self._futures = None
        return self._done


class CrfPool:
    """Dense CRF over many images in worker processes; the images are sent to each worker once."""

    def __init__(self, images_hwc: np.ndarray, config: CrfConfig, workers: int):
        self.images, self.config, self.workers = images_hwc, config, workers
        # spawn: forking a process with torch's thread pools running can deadlock the child.
        self.pool = worker_pool(workers, start_method="spawn", initializer=_init_crf_worker,
                                initargs=(images_hwc, config)) if workers > 1 else None

    def submit(self, probabilities: np.ndarray) -> Refinement:
        """The CRF of `probabilities` [N, S, S] (image i's map at index i), refined in the workers while the caller
        goes on (in this process, before it returns, without workers)."""
        if self.pool is None:
            return Refinement(done=np.stack([dense_crf(self.images[i], p, self.config)
                                             for i, p in enumerate(probabilities)]))
        chunks = np.array_split(np.arange(len(probabilities)), self.workers * 4)
        return Refinement([self.pool.submit(_crf_chunk, c, probabilities[c]) for c in chunks if len(c)])

    def close(self, cancel: bool = False) -> None:
        """Stop the workers; with `cancel`, the chunks not yet started are dropped (the job was interrupted)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=cancel)
            self.pool = None

    def __enter__(self) -> CrfPool:
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.close(cancel=exc_type is not None)

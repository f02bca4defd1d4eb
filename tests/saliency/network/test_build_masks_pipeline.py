"""`saliency build-masks` pipeline: chunked pool tasks (in worker processes or in the job's own), asynchronous
forwards, the mask encoding, and OpenCV's thread count around the job."""

from __future__ import annotations

import io
import tarfile

import cv2
import numpy as np
import pytest
from PIL import Image

from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks
from relicv2.saliency.network.images import resize_map
from relicv2.saliency.network.mask_shard import chunks
from relicv2.saliency.network.mask_work import RawSample, finish
from relicv2.shards import read_rejected, write_index, write_shard_set
from relicv2.shards.build import Ranks
from tests.saliency.network.conftest import SquarePredictor, scene_samples


def _run(model, shards, out, predictor, workers: int = 2, batch_size: int = 3) -> dict:
    config = BuildMasksConfig(model=model, shards=shards, out=out, workers=workers, batch_size=batch_size, progress=False)
    return build_masks(config, Ranks(), predictor=predictor)


def _tars(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("masked-*"))}


class SmoothPredictor(SquarePredictor):
    """A smooth, image-dependent map (every grey level, values at 0.5 and outside [0, 1] included)."""

    def __call__(self, squares):
        ramp = np.linspace(-0.1, 1.1, self.size, dtype=np.float32)
        return np.stack([ramp[None, :] * (1.0 + sq.mean() / 1024.0) + ramp[:, None] * 0.1 for sq in squares])


class LaunchingPredictor(SmoothPredictor):
    """Has `launch`, like MaskPredictor: records the order of launches and waits."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def launch(self, squares, out=None):  # leaves `out` to the job: a predictor may return its own array
        number = sum(e.startswith("launch") for e in self.events)
        self.events.append(f"launch {number}")
        assert cv2.getNumThreads() == 1  # OpenCV single-threaded while the pool works
        probabilities = self(squares)

        def wait():
            self.events.append(f"wait {number}")
            return probabilities

        return wait


@pytest.mark.parametrize(("count", "parts"), [(0, 3), (1, 3), (7, 3), (9, 3), (64, 8), (5, 1)])
def test_chunks_cover_every_item_once_in_order(count, parts) -> None:
    sliced = chunks(count, parts)
    assert [i for part in sliced for i in range(count)[part]] == list(range(count))
    assert len(sliced) <= parts and all(part.stop > part.start for part in sliced)


def test_output_does_not_depend_on_workers_or_batch(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards  # 0: everything in this process, the ring included; 3: worker processes
    _run(tiny_model, shards, tmp_path / "one", SmoothPredictor(), workers=0, batch_size=4)
    _run(tiny_model, shards, tmp_path / "three", SmoothPredictor(), workers=3, batch_size=3)
    assert _tars(tmp_path / "one") == _tars(tmp_path / "three")


def test_launching_predictor_gives_the_same_output_one_batch_in_flight(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    threads = cv2.getNumThreads()
    launching = LaunchingPredictor()
    summary = _run(tiny_model, shards, tmp_path / "launched", launching)
    _run(tiny_model, shards, tmp_path / "called", SmoothPredictor())
    assert _tars(tmp_path / "launched") == _tars(tmp_path / "called")
    # Three shards of 4 samples in batches of 3: two batches per shard, each waited for before the next.
    assert launching.events == [f"{kind} {n}" for n in range(6) for kind in ("launch", "wait")]
    assert cv2.getNumThreads() == threads  # restored after the job
    assert 0 <= summary["forward_s"] <= summary["main_thread_s"]
    assert 0 <= summary["waiting_for_pool_s"] <= summary["main_thread_s"]


def test_mask_is_the_rounded_resized_map_and_the_map_is_left_alone() -> None:
    probability = SmoothPredictor()([np.full((32, 32, 3), 100, np.uint8)])[0]
    probability[5, 5] = 0.5  # a value at the coverage threshold
    before = probability.copy()
    sample = RawSample("k", b"jpeg bytes", None, {})
    record = finish(sample, probability, 40, 30)
    soft = resize_map(before, 40, 30)
    expected = np.clip(np.rint(soft * 255.0), 0, 255).astype(np.uint8)
    blob = record.blob
    start, size = next((off, size) for ext, off, size in record.entries if ext == "mask.png")
    mask = np.asarray(Image.open(io.BytesIO(blob[start:start + size])))
    assert np.array_equal(mask, expected)
    assert soft.min() < 0 and soft.max() > 1  # clipping was exercised at both ends
    assert record.row["mask_coverage"] == round(float((soft >= 0.5).mean()), 6)
    assert np.array_equal(probability, before)


def test_a_batch_the_reader_rejects_whole_is_skipped(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(2)
    folder = tmp_path / "in"
    write_shard_set(samples, folder)
    tar = folder / "images-000000.tar"
    with tarfile.open(tar, "a") as archive:  # a sample without an image: rejected before decoding
        info = tarfile.TarInfo("lonely.json")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"{}"))
    write_index(tar)
    (folder / "manifest.parquet").unlink()
    summary = _run(tiny_model, folder, tmp_path / "out", SmoothPredictor(), batch_size=1)
    assert (summary["written"], summary["rejected"]) == (2, 1)
    assert [r["reason"] for r in read_rejected(tmp_path / "out").to_pylist()] == ["no_image"]

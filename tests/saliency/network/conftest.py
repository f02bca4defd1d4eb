"""Fixtures: generated object-on-background shard sets and a tiny saliency model file."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import save_model
from relicv2.shards import ShardSample, write_shard_set
from tests.scenes import synthetic_scene


def jpeg_bytes(rgb: np.ndarray, exif=None) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(rgb)
    if exif is not None:
        image.save(buffer, "JPEG", quality=95, exif=exif)
    else:
        image.save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def scene_samples(count: int, *, height: int = 48, width: int = 64, labelled: bool = True, start: int = 0):
    samples, masks = [], {}
    for i in range(start, start + count):
        rgb, mask = synthetic_scene(height, width, seed=i)
        key = f"scene{i:03d}"
        masks[key] = mask
        meta = {"width": width, "height": height, "source": f"{key}.jpg"}
        samples.append(ShardSample(key, {"jpg": jpeg_bytes(rgb)}, i % 3 if labelled else None, meta))
    return samples, masks


@pytest.fixture
def scene_shards(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Three shards of four generated scenes each (48 x 64), with their true object masks."""
    samples, masks = scene_samples(12)
    folder = tmp_path / "scenes"
    write_shard_set(samples, folder, max_count=4)
    return folder, masks


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Path:
    """The folder of a randomly initialised (seed 0) ResNet-18 saliency model file at 32 px, made once."""
    import torch

    torch.manual_seed(0)
    return save_model(tmp_path_factory.mktemp("tiny-model") / "model.pt", SaliencyNet(18).eval(), input_size=32,
                      preset="tiny", backbone="random initialisation", config={}, report={}).parent


@pytest.fixture
def tiny_model(tmp_path: Path, tiny_model_folder: Path) -> Path:
    """A copy of the tiny model's folder for the test (tests write beside the file or change it): a copy
    costs a tenth of building and saving the network again."""
    return shutil.copytree(tiny_model_folder, tmp_path / "model") / "model.pt"


class SquarePredictor:
    """Stands in for the network: probability 1 inside the centre square of half the side, else 0."""

    size = 32
    info = {"input_size": size}  # a model file's description, as MaskPredictor.info (no config: default CRF)

    def __call__(self, squares):
        out = np.zeros((len(squares), self.size, self.size), np.float32)
        q = self.size // 4
        out[:, q : 3 * q, q : 3 * q] = 1.0
        return out


@pytest.fixture(autouse=True)
def tiny_networks_on_one_thread(one_thread):
    """Tiny networks: one intra-op thread is faster, and far faster on a busy shared CPU (torch's
    second thread spins at every barrier while descheduled)."""
    yield

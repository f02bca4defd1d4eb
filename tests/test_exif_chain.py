"""EXIF orientation end to end: one convention, the displayed orientation.

A FOREIGN shard set (written with webdataset's ShardWriter, as a user's own set would be) holds a
JPEG stored 200 wide x 100 high (red left, blue right) with EXIF orientation 6, so it is displayed
100 wide x 200 high with red on top and blue below, plus a `mask.png` made at the displayed size
marking the red half. Every stage must see the displayed image: shards verify, saliency
build-masks, both view backends (mask and image agree, and the backends agree), kNN
preprocessing and handcrafted saliency maps.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.pretrain.knn.extract import preprocess
from relicv2.pretrain.views.config import PARAM_NAMES, ViewConfig
from relicv2.pretrain.views.loader import ViewLoader, dali_available
from relicv2.shards import (
    ReadReport,
    iter_samples,
    read_manifest,
)
from tests.exif_images import orientation6_displayed, orientation6_jpeg, upright_jpeg

ROTATED = "rotated"
GREY = 0.5  # background grey level of masked views (fixed below)
VIEW = 32


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, "PNG")
    return out.getvalue()


def _ordinary_jpeg(seed: int) -> bytes:
    """A green-ish landscape photo stand-in, without EXIF."""
    rng = np.random.default_rng(seed)
    rgb = np.zeros((48, 64, 3), np.uint8)
    rgb[..., 1] = rng.integers(100, 200)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.fixture(scope="module", autouse=True)
def index_cache(tmp_path_factory):
    """Derived index files go to a folder of this module, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RELICV2_INDEX_CACHE", str(tmp_path_factory.mktemp("index-cache")))
        yield


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    """A plain WebDataset set: the rotated JPEG with its displayed-size mask, and five ordinary images."""
    import webdataset as wds

    folder = tmp_path_factory.mktemp("foreign")
    mask = np.zeros((200, 100), np.uint8)  # displayed size: 100 wide, 200 high; red (top) half is foreground
    mask[:100] = 255
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=3, verbose=0) as sink:
        sink.write({"__key__": ROTATED, "jpg": orientation6_jpeg(), "mask.png": _png(mask), "cls": b"0"})
        for i in range(5):
            sink.write({"__key__": f"plain{i}", "jpg": _ordinary_jpeg(i), "cls": str(i % 2).encode()})
    return folder  # no manifest, no index files: every reader derives the indexes into the cache


class RedPredictor:
    """Stands in for the saliency network: foreground where the (square) input is red."""

    size = 32

    def __call__(self, squares):
        batch = np.stack(squares).astype(np.float32)
        return ((batch[..., 0] > 128) & (batch[..., 2] < 128)).astype(np.float32)


@pytest.fixture(scope="module")
def masked(foreign, tmp_path_factory) -> Path:
    """`saliency build-masks` output of the foreign set (a tiny model file, a red-finding predictor)."""
    from relicv2.saliency.network.build_masks import BuildMasksConfig, build_masks
    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model
    from relicv2.shards.build import Ranks

    base = tmp_path_factory.mktemp("masks")
    torch.manual_seed(0)
    model = save_model(base / "model.pt", SaliencyNet(18).eval(), input_size=32, preset="tiny",
                       backbone="random initialisation", config={}, report={})
    config = BuildMasksConfig(model=model, shards=foreign, out=base / "out", workers=1, batch_size=4, progress=False)
    summary = build_masks(config, Ranks(), predictor=RedPredictor())
    assert summary["written"] == 6 and summary["rejected"] == 0
    return base / "out"


def _run(args: list[str]):
    from relicv2.cli.main import cli

    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_verify_accepts_both_sets_and_checks_displayed_sizes(foreign, masked):
    for folder in (foreign, masked):
        result = _run(["shards", "verify", str(folder), "--workers", "1", "--no-progress"])
        assert result.exit_code == 0, result.output
    rows = {r["key"]: r for r in read_manifest(masked).to_pylist()}
    assert (rows[ROTATED]["width"], rows[ROTATED]["height"]) == (100, 200)


def test_build_masks_writes_the_mask_at_the_displayed_size_over_the_red_half(masked):
    sample = {s["key"]: s for s in iter_samples(masked, report=ReadReport())}[ROTATED]
    assert sample["jpg"] == orientation6_jpeg()  # copied unchanged
    mask = np.asarray(Image.open(io.BytesIO(sample["mask.png"])))
    assert mask.shape == (200, 100)
    assert mask[:90].mean() > 200 and mask[110:].mean() < 50  # displayed red (top) half is the foreground
    assert (sample["meta"]["width"], sample["meta"]["height"]) == (100, 200)


def _views_of_rotated(folder: Path, backend: str) -> torch.Tensor:
    """The rotated sample's large views (in [0, 1], N x 3 x H x W) from one epoch of `backend`."""
    cfg = ViewConfig(
        large_views=2, small_views=0, large_size=VIEW, crop_scale_even=(1.0, 1.0), crop_scale_odd_large=(1.0, 1.0),
        crop_ratio=(0.5, 0.5), flip_probability=0.0, jitter_probability=0.0, grayscale_probability=0.0,
        blur_probability_even=0.0, blur_probability_odd=0.0, solarize_probability_odd=0.0, mask_probability=1.0,
        mask_min_coverage=0.01, mask_grey_range=(GREY, GREY), debug_params=True, num_threads=1,
    )
    loader = ViewLoader(folder, 3, cfg, backend=backend)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for batch in loader:
        if ROTATED in batch["keys"]:
            i = batch["keys"].index(ROTATED)
            assert batch["params"][i, :, PARAM_NAMES.index("masked")].tolist() == [1.0, 1.0]
            return torch.stack([v[i].float().cpu() * std + mean for v in batch["views"]])
    raise AssertionError(f"{ROTATED} was not delivered in an epoch of {backend}")


BACKENDS = ["reference", pytest.param("dali", marks=pytest.mark.skipif(not dali_available(), reason="no DALI"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["foreign", "masked"])
def test_views_keep_the_red_half_and_grey_the_blue_half(foreign, masked, backend, which):
    # The foreign set as it is (its hand-made displayed-size mask) and build-masks' output of it.
    views = _views_of_rotated(foreign if which == "foreign" else masked, backend)
    top, bottom = views[:, :, 2 : VIEW // 2 - 3], views[:, :, VIEW // 2 + 3 : -2]
    # Kept: the displayed top half is red (not grey, not blue).
    assert top[:, 0].mean() > 0.9 and top[:, 1].mean() < 0.1 and top[:, 2].mean() < 0.1
    # Masked out: the displayed bottom half is the background grey (no blue left).
    assert (bottom - GREY).abs().max() < 0.06


@pytest.mark.skipif(not dali_available(), reason="no DALI")
def test_both_backends_mask_the_same_half(masked):
    reference, dali = _views_of_rotated(masked, "reference"), _views_of_rotated(masked, "dali")
    assert (reference - dali).abs().mean() < 0.03


def test_knn_preprocessing_sees_the_portrait_image():
    rotated = preprocess(orientation6_jpeg(), crop_size=32, resize_size=32)
    upright = preprocess(upright_jpeg(), crop_size=32, resize_size=32)
    assert (rotated - upright).abs().mean() < 0.05
    # Portrait: the centre crop of a 100 x 200 image is red above, blue below.
    red = (1.0 - IMAGENET_MEAN[0]) / IMAGENET_STD[0]
    assert rotated[0, :12].mean() > red - 0.2 and rotated[0, -12:].mean() < 0


def test_handcrafted_maps_have_the_displayed_size(foreign, tmp_path):
    result = _run(["saliency", "handcrafted", "--method", "rbd", "--input", str(foreign),
                   "--output", str(tmp_path / "maps"), "--no-progress"])
    assert result.exit_code == 0, result.output
    saliency_map = np.asarray(Image.open(tmp_path / "maps" / "rbd" / f"{ROTATED}.png"))
    assert saliency_map.shape == orientation6_displayed().shape[:2]


def test_every_reader_applies_the_pixel_limit():
    """One loader, one pixel-limit policy: a decompression bomb is refused from its header by the
    reference views, kNN preprocessing and the saliency network's decoder alike (ImageLoadError,
    a ValueError: the samples are reported and skipped by their callers)."""
    from relicv2.pretrain.views.reference import augment_sample
    from relicv2.saliency.network.mask_work import RawSample, prepare
    from relicv2.shards import ImageLoadError
    from relicv2.shards.images import load_rgb
    from tests.shards.test_hostile import bomb_png

    bomb = bomb_png()
    with pytest.raises(ImageLoadError, match="pixels, over the limit"):
        augment_sample(bomb, None, ViewConfig(), np.random.default_rng(0))
    with pytest.raises(ImageLoadError, match="pixels, over the limit"):
        augment_sample(upright_jpeg(), bomb, ViewConfig(), np.random.default_rng(0))
    with pytest.raises(ImageLoadError, match="pixels, over the limit"):
        preprocess(bomb, crop_size=32, resize_size=32)
    with pytest.raises(ImageLoadError, match="pixels, over the limit"):
        load_rgb(bomb, "bomb")
    assert prepare(RawSample("bomb", bomb, None, {}), 32).reason == "too_large"

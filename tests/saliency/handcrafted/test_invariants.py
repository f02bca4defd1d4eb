"""What every handcrafted method guarantees, tested over the registry ``METHODS``.

Map shape, dtype and range; determinism; the object ranked above the background on synthetic
scenes; flat, tiny, greyscale, RGBA, framed and extreme-aspect inputs; the config dataclass
each method takes. A method added to the registry is covered here without a new test.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import cache

import numpy as np
import pytest

from relicv2.saliency.handcrafted import METHOD_NAMES, resolve_methods
from relicv2.saliency.handcrafted.methods import CONFIGS, METHODS
from tests.scenes import striped_scene, synthetic_scene

NAMES = list(METHODS)
SCENES = {
    "plain-0": lambda: synthetic_scene(96, 128, seed=0),
    "plain-1": lambda: synthetic_scene(96, 128, seed=1),
    "striped": lambda: striped_scene(96, 128, seed=0),
}
# Every method scores gap >= 0.86 and AUC >= 0.993 on these scenes (measured 2026-11-23);
# the thresholds leave room for library versions, not for a method that lost the object.
MIN_GAP = 0.8
MIN_AUC = 0.98


@cache
def _scene(name: str) -> tuple[np.ndarray, np.ndarray]:
    return SCENES[name]()


@cache
def _map(method: str, scene: str) -> np.ndarray:
    return METHODS[method](_scene(scene)[0])


def _auc(saliency: np.ndarray, mask: np.ndarray) -> float:
    """Probability that a random object pixel outranks a random background pixel."""
    # Imported here: scipy.stats costs ~1 s at collection in every test process.
    from scipy.stats import rankdata

    ranks = rankdata(saliency.ravel())
    inside = mask.ravel() > 0
    n_in, n_out = inside.sum(), (~inside).sum()
    return float((ranks[inside].sum() - n_in * (n_in + 1) / 2) / (n_in * n_out))


def _check_map(saliency: np.ndarray, shape: tuple[int, ...]) -> None:
    assert saliency.dtype == np.float32
    assert saliency.shape == shape
    assert np.isfinite(saliency).all()
    assert saliency.min() >= 0.0 and saliency.max() <= 1.0


@pytest.mark.parametrize("scene", list(SCENES))
@pytest.mark.parametrize("method", NAMES)
def test_object_ranked_above_background(method, scene):
    _, mask = _scene(scene)
    saliency = _map(method, scene)
    _check_map(saliency, mask.shape)
    assert saliency.max() == 1.0 and saliency.min() == 0.0  # the full range is used
    gap = saliency[mask > 0].mean() - saliency[mask == 0].mean()
    assert gap > MIN_GAP, gap
    assert _auc(saliency, mask) > MIN_AUC


@pytest.mark.parametrize("method", NAMES)
def test_deterministic(method):
    again = METHODS[method](_scene("plain-0")[0].copy())
    np.testing.assert_array_equal(again, _map(method, "plain-0"))


@pytest.mark.parametrize("method", NAMES)
def test_greyscale_and_rgba_inputs(method):
    rgb, _ = _scene("plain-1")
    # the red channel keeps the object's contrast, so the greyscale map is not trivial
    grey = np.ascontiguousarray(rgb[:, :, 0])
    as_grey = METHODS[method](grey)
    _check_map(as_grey, grey.shape)
    np.testing.assert_array_equal(as_grey, METHODS[method](np.dstack([grey] * 3)))
    assert as_grey.max() == 1.0
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 90, np.uint8)])  # alpha is dropped
    np.testing.assert_array_equal(METHODS[method](rgba), _map(method, "plain-1"))


@pytest.mark.parametrize("colour", [0, 77, 255])
@pytest.mark.parametrize("method", NAMES)
def test_flat_image_is_all_zero(method, colour):
    saliency = METHODS[method](np.full((40, 52, 3), colour, np.uint8))
    _check_map(saliency, (40, 52))
    assert saliency.max() == 0.0


def _odd_inputs() -> dict[str, np.ndarray]:
    rgb, _ = synthetic_scene(64, 80, seed=4)
    framed = np.full((104, 120, 3), 255, np.uint8)
    framed[20:-20, 20:-20] = rgb
    strip = np.ascontiguousarray(np.tile(rgb[:12], (1, 6, 1)))
    return {
        "tiny": rgb[20:40, 30:54],
        "one_pixel": rgb[:1, :1],
        "one_column": rgb[:, :1],
        "two_colours": np.repeat(np.array([[[0, 0, 0], [255, 255, 255]]], np.uint8), 20, axis=0),
        "framed": framed,
        "tall": np.ascontiguousarray(strip.transpose(1, 0, 2)),
    }


@pytest.mark.parametrize("case", list(_odd_inputs()))
@pytest.mark.parametrize("method", NAMES)
def test_odd_inputs_give_a_defined_map_without_warnings(method, case):
    image = _odd_inputs()[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero, no NaN on the way either
        saliency = METHODS[method](image)
    _check_map(saliency, image.shape[:2])


@pytest.mark.parametrize("method", NAMES)
def test_rejects_what_is_not_an_image(method):
    with pytest.raises(ValueError, match="expected an image"):
        METHODS[method](np.zeros((8, 8, 2), np.uint8))


@pytest.mark.parametrize("method", NAMES)
def test_config_is_frozen_and_used(method):
    config = CONFIGS[method]()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    first = dataclasses.fields(config)[0]  # the superpixel count (or the scales) comes first
    coarser = {
        "pixels_per_superpixel": 2400,
        "superpixels": 40,
        "scales": ((40, 10.0), (80, 20.0)),
    }[first.name]
    changed = METHODS[method](_scene("plain-0")[0], dataclasses.replace(config, **{first.name: coarser}))
    _check_map(changed, _scene("plain-0")[1].shape)
    assert not np.array_equal(changed, _map(method, "plain-0"))


def test_registry_is_explicit():
    assert list(METHODS) == ["rbd", "mr", "dsr", "mc"] and list(CONFIGS) == list(METHODS)
    assert tuple(METHODS) == METHOD_NAMES  # the names that configs and commands use without the functions
    assert resolve_methods("all") == ["rbd", "mr", "dsr", "mc"]
    assert resolve_methods("mr, rbd") == ["mr", "rbd"]
    with pytest.raises(ValueError, match="unknown"):
        resolve_methods("rbd,gs")
    with pytest.raises(ValueError, match="unknown"):
        resolve_methods(" , ")

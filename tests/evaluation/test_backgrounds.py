"""The backgrounds test's composites: a model that reads the background loses mixed-rand and shows a BG-gap;
one that reads the foreground keeps every variant that keeps the foreground; pairings follow the seed."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from relicv2.evaluation.backgrounds import (
    MIXED,
    VARIANTS,
    Cutout,
    bg_gap,
    cutout,
    follows_background,
    pairings,
    tiled_background,
    variant,
)
from tests.evaluation.backdrops import PALETTE, crafted, scene


def _accuracies(carried_by: str) -> tuple[dict[str, float], float]:
    train_images, _, train_labels = crafted(carried_by, seed=1)
    images, masks, labels = crafted(carried_by, seed=2)
    features = lambda batch: np.stack(batch).reshape(len(batch), -1) / 255.0  # noqa: E731
    model = LogisticRegression(max_iter=2000).fit(features(train_images), train_labels)
    cuts = [cutout(mask) for mask in masks]
    assert all(isinstance(cut, Cutout) for cut in cuts)
    partners = pairings(labels, seed=0)
    accuracy, predictions = {}, {}
    for name in VARIANTS:
        batch = [variant(name, image, cut, (images[partners[MIXED[name]][i]], cuts[partners[MIXED[name]][i]])
                         if name in MIXED else None) for i, (image, cut) in enumerate(zip(images, cuts, strict=True))]
        predictions[name] = model.predict(features(batch))
        accuracy[name] = float((predictions[name] == labels).mean())
    follows = follows_background(predictions["mixed_rand"], labels, labels[partners["rand"]])
    return accuracy, follows


def test_a_model_that_reads_the_background_falls_to_chance_on_mixed_rand():
    accuracy, follows = _accuracies("background")
    assert accuracy["original"] > 0.95 and accuracy["mixed_same"] > 0.9
    assert accuracy["mixed_rand"] < 0.5 and accuracy["mixed_next"] < 0.1  # chance is 1/3; next is never right
    assert bg_gap(accuracy) > 0.45
    assert follows > 0.9
    assert accuracy["only_bg_t"] > 0.9 and accuracy["only_fg"] < 0.6


def test_a_model_that_reads_the_foreground_keeps_every_variant_with_the_foreground():
    accuracy, _ = _accuracies("foreground")
    for name in ("original", "only_fg", "mixed_same", "mixed_rand", "mixed_next"):
        assert accuracy[name] > 0.9, (name, accuracy)
    assert abs(bg_gap(accuracy)) < 0.1
    assert accuracy["no_fg"] < 0.6 and accuracy["only_bg_b"] < 0.6


def test_pairings_follow_the_seed_and_their_definitions():
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 0, 2, 1])
    first, again, other = pairings(labels, 3), pairings(labels, 3), pairings(labels, 4)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert any(not np.array_equal(first[k], other[k]) for k in first)
    assert np.array_equal(labels[first["same"]], labels) and np.all(first["same"] != np.arange(len(labels)))
    assert np.array_equal(labels[first["next"]], (labels + 1) % 3)


def test_the_tiled_box_holds_only_the_image_own_background():
    image = np.zeros((40, 40, 3), np.uint8)
    image[:, :] = (10, 20, 30)
    image[:8] = (200, 0, 0)  # the top strip is red, the rest of the background blue-ish
    image[15:30, 5:35] = (0, 255, 0)
    mask = np.zeros((40, 40), np.uint8)
    mask[15:30, 5:35] = 255
    cut = cutout(mask)
    tiled = tiled_background(image, cut)
    box = tiled[15:30, 5:35].reshape(-1, 3)
    assert not np.any(np.all(box == (0, 255, 0), axis=1))  # no foreground pixel left in the box
    assert {tuple(p) for p in box} <= {(10, 20, 30), (200, 0, 0)}
    assert np.array_equal(tiled[:15], image[:15]) and np.array_equal(tiled[30:], image[30:])


@pytest.mark.parametrize(("mask_area", "code", "words"), [
    ((slice(0, 3), slice(0, 3)), "small_mask", "under the masking"),
    ((slice(1, 40), slice(1, 40)), "large_box", "over 90%"),
    ((slice(20, 21), slice(0, 40)), "large_box", "over 90%"),  # a thin cross over the view: 7% of it, its box all
])
def test_images_whose_mask_is_too_small_or_too_large_are_left_out_with_why(mask_area, code, words):
    mask = np.zeros((40, 40), np.uint8)
    mask[mask_area] = 255
    if mask_area[1] == slice(0, 40):
        mask[:, 20:22] = 255
    left_out = cutout(mask)
    assert left_out[0] == code and words in left_out[1]


def test_the_rules_look_at_the_centre_crop_the_encoder_sees():
    mask = np.zeros((40, 40), np.uint8)
    mask[:, :6] = 255  # 15% of the square, none of it in the centre 28 x 28
    assert isinstance(cutout(mask), Cutout) and cutout(mask, crop=28)[0] == "small_mask"


def test_an_unknown_variant_and_a_mixed_one_without_partner_are_refused():
    image, mask = scene(np.random.default_rng(0), PALETTE[0], PALETTE[1])
    cut = cutout(mask)
    with pytest.raises(ValueError, match="unknown variant 'blur'"):
        variant("blur", image, cut)
    with pytest.raises(ValueError, match="needs a partner"):
        variant("mixed_rand", image, cut)

"""Saliency metrics against values computed by hand on tiny maps, and against the README scores."""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.metrics import (
    adaptive_f_measure,
    aggregate,
    binarise_ground_truth,
    f_measure_curve,
    normalise_prediction,
    s_measure,
    score_image,
    summed,
)

# S = [0, 0.5, 0.75, 1], G = [0, 1, 0, 1]; by hand, beta^2 = 0.3, F = 1.3 P R / (0.3 P + R):
#   t = 0        : all positive  -> P 1/2, R 1   -> F = 0.65 / 1.15
#   t = 1..127   : {.5, .75, 1}  -> P 2/3, R 1   -> F = 0.8667 / 1.2
#   t = 128..191 : {.75, 1}      -> P 1/2, R 1/2 -> F = 0.325 / 0.65 = 0.5
#   t = 192..255 : {1}           -> P 1,   R 1/2 -> F = 0.65 / 0.8 = 0.8125
S = np.array([[0.0, 0.5], [0.75, 1.0]])
G = np.array([[0, 255], [0, 255]], np.uint8)


def test_f_measure_curve_by_hand():
    curve = f_measure_curve(normalise_prediction(S), binarise_ground_truth(G))
    assert curve.shape == (256,)
    assert curve[0] == pytest.approx(0.65 / 1.15)
    assert curve[1] == pytest.approx((1.3 * 2 / 3) / 1.2) and curve[127] == pytest.approx(curve[1])
    assert curve[128] == pytest.approx(0.5) and curve[191] == pytest.approx(0.5)
    assert curve[192] == pytest.approx(0.8125) and curve[255] == pytest.approx(0.8125)


def test_adaptive_f_and_mae_by_hand():
    s, g = normalise_prediction(S), binarise_ground_truth(G)
    # mean(S) = 0.5625 -> threshold min(1.125, 1) = 1 -> only the last pixel: P 1, R 1/2.
    assert adaptive_f_measure(s, g) == pytest.approx(0.8125)
    scores = score_image(S, G)
    assert scores.mae == pytest.approx((0 + 0.5 + 0.75 + 0) / 4)
    # An all-zero map has threshold 0, so every pixel counts as positive (P 1/2, R 1).
    assert adaptive_f_measure(np.zeros((2, 2)), g) == pytest.approx(0.65 / 1.15)
    # A mask without foreground has recall 0/0: F counts as 0, never NaN.
    assert adaptive_f_measure(s, np.zeros((2, 2), bool)) == 0.0
    assert (f_measure_curve(s, np.zeros((2, 2), bool)) == 0).all()


def test_predictions_are_min_max_normalised_and_gt_binarised_at_128():
    raw = np.array([[50, 100], [150, 250]], np.uint8)
    assert np.allclose(normalise_prediction(raw), [[0, 0.25], [0.5, 1]])
    assert (normalise_prediction(np.full((2, 2), 9)) == 0).all()
    assert binarise_ground_truth(np.array([127, 128], np.uint8)).tolist() == [False, True]


def test_max_f_is_the_maximum_of_the_mean_curve():
    first = score_image(S, G)
    # Second image peaks at low thresholds (F = .7222 for t <= 102, 0 above), the first at high
    # ones (.8125 for t >= 192): the mean curve's maximum is below the mean of the maxima.
    second = score_image(np.array([[0.0, 0.4], [1.0, 0.4]]), G)
    result = aggregate([first, second])
    mean_curve = (first.f_curve + second.f_curve) / 2
    assert result.max_f == pytest.approx(mean_curve.max())
    assert result.max_f == pytest.approx((1.3 * 2 / 3) / 1.2)
    assert result.max_f < (first.f_curve.max() + second.f_curve.max()) / 2
    assert result.count == 2 and result.mae == pytest.approx((first.mae + second.mae) / 2)


def test_the_sums_of_a_subset_score_it_as_scoring_it_directly():
    rng = np.random.default_rng(3)
    images = [score_image(rng.random((6, 7)) ** (1 + i % 3), (rng.random((6, 7)) > 0.6 + 0.05 * (i % 4)) * 255)
              for i in range(10)]
    subset, rest = images[1:8:2], [image for i, image in enumerate(images) if i not in (1, 3, 5, 7)]
    for part in (subset, rest, images):
        direct = aggregate(part)
        from_sums = summed(part).scores()
        assert from_sums.count == direct.count == len(part)
        for field in ("mae", "max_f", "adaptive_f", "s_measure"):
            assert getattr(from_sums, field) == pytest.approx(getattr(direct, field), abs=1e-12)
    # Disjoint sets add up to their union; max-F of the union is not the mean of the parts' max-F.
    union = (summed(subset) + summed(rest)).scores()
    assert union.max_f == pytest.approx(aggregate(images).max_f, abs=1e-12)
    assert union.mae == pytest.approx(aggregate(images).mae, abs=1e-12)
    assert union.max_f != pytest.approx((aggregate(subset).max_f * 4 + aggregate(rest).max_f * 6) / 10, abs=1e-6)
    assert summed([]).scores().count == 0


def test_s_measure_special_cases():
    s = np.array([[0.2, 0.4], [0.6, 0.8]])
    assert s_measure(s, np.zeros((2, 2), bool)) == pytest.approx(1 - 0.5)
    assert s_measure(s, np.ones((2, 2), bool)) == pytest.approx(0.5)
    g = np.array([[0, 1, 1, 0], [0, 1, 1, 0]], bool)
    assert s_measure(g.astype(float), g) == pytest.approx(1.0)


def test_s_measure_by_hand_single_pixel_quadrants():
    # G = [[1, 0], [0, 0]], S = [[.8, .2], [0, .4]]
    # object: fg x=.8, sd 0 -> 1.6/1.64; bg 1-S = [.8, 1, .6]: x=.8, sd .2 -> 1.6/1.84
    # S_o = .25 * .975610 + .75 * .869565 = .896076; centroid (1, 1): four 1-pixel quadrants
    # whose ssim terms are all 0/0 -> 1, so S_r = 1;  S = (.896076 + 1) / 2
    value = s_measure(np.array([[0.8, 0.2], [0.0, 0.4]]), np.array([[1, 0], [0, 0]], bool))
    assert value == pytest.approx((0.25 * 1.6 / 1.64 + 0.75 * 1.6 / 1.84 + 1) / 2, abs=1e-6)


def test_s_measure_by_hand_matlab_rounding():
    # G = [[0,1,1,0],[0,1,1,0]]: centroid x = 2.5 -> MATLAB round = 3, y = 1.5 -> 2,
    # so the split is 3 columns | 1 column with weights .75 / .25 (bottom quadrants empty).
    # object: fg [1,.5,1,1] x=.875 sd=.25 -> 1.75/2.015625; bg 1-S [1,1,.5,.5] x=.75
    #   sd=.288675 -> 1.5/1.851175; S_o = (.868217 + .810296)/2 = .839257
    # left block: x = y = 2/3, var_x = 1/6, var_y = 4/15, cov = 1/6
    #   -> 4 * 4/9 * 1/6 / (8/9 * (1/6 + 4/15)) = .769231; right column: y = 0, beta > 0 -> 0
    # S_r = .75 * .769231 = .576923;  S = (.839257 + .576923) / 2 = .708090
    s = np.array([[0.0, 1.0, 0.5, 0.0], [0.5, 1.0, 1.0, 0.5]])
    g = np.array([[0, 1, 1, 0], [0, 1, 1, 0]], bool)
    assert s_measure(s, g) == pytest.approx(0.708090, abs=1e-5)


def test_reference_maps_reproduce_the_published_dev_scores(shared_data):
    # README of the data: RBD reference maps on 0001-0100 score .202 / .560 / .542.
    from relicv2.saliency.images import read_gray

    root = shared_data / "pascal-s-dev"
    stems = sorted(p.stem for p in (root / "reference-maps" / "rbd").glob("*.png"))[:100]
    result = aggregate(
        score_image(read_gray(root / "reference-maps" / "rbd" / f"{s}.png"), read_gray(root / "masks" / f"{s}.png"))
        for s in stems
    )
    assert result.count == 100
    assert (round(result.mae, 3), round(result.max_f, 3), round(result.adaptive_f, 3)) == (0.202, 0.560, 0.542)

"""`saliency.selection`: folds, the dev images kept out of training, nested selection, paired differences."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image

from relicv2.saliency.metrics import THRESHOLDS, ScoreSums
from relicv2.saliency.selection import (
    DevImageInTrainingError,
    assign_folds,
    check_kept_out,
    fold_sums,
    paired_difference,
    select,
)
from tests.scenes import synthetic_scene


def test_folds_never_share_an_image_and_cover_all():
    stems = [f"{i:04d}" for i in range(1, 24)]
    folds = assign_folds(stems, 5, seed=0)
    assert len(folds) == 5
    flat = [stem for fold in folds for stem in fold]
    assert sorted(flat) == stems and len(set(flat)) == len(flat)  # disjoint, and every image in one
    assert sorted(len(fold) for fold in folds) == [4, 4, 5, 5, 5]
    # Fixed by the names and the seed: not by their order, and another seed deals other folds.
    assert assign_folds(reversed(stems), 5, seed=0) == folds
    assert assign_folds(stems, 5, seed=1) != folds
    with pytest.raises(ValueError, match="2 folds or more"):
        assign_folds(stems, 1, seed=0)
    with pytest.raises(ValueError, match="at most one an image"):
        assign_folds(stems[:3], 5, seed=0)


def test_a_fold_sum_refuses_scores_of_other_images():
    with pytest.raises(ValueError, match="no score for 1 dev image"):
        fold_sums({}, [["0001"]], "rows: rbd")


def _fold(max_f: float, mae: float = 0.2, count: int = 10) -> ScoreSums:
    """A fold's sums whose mean F curve is flat at `max_f`."""
    return ScoreSums(mae * count, np.full(THRESHOLDS, max_f * count), 0.0, 0.0, count)


def test_selection_never_scores_a_candidate_on_the_fold_it_was_chosen_on():
    # A is better on folds 1-4, B far better on fold 0: chosen on all five folds B wins (.678 against .660),
    # chosen on folds 1-4 A wins, so held-out fold 0 must be scored by A.
    candidates = {"A": [_fold(0.50), *[_fold(0.70)] * 4], "B": [_fold(0.99), *[_fold(0.60)] * 4]}
    assert max(candidates, key=lambda n: sum(candidates[n], ScoreSums.empty()).scores().max_f) == "B"
    selection = select(candidates)
    assert selection.chosen[0] == "A"
    # For folds 1-4 the other folds include fold 0: B (.6975 against .65), scored on each of them.
    assert selection.chosen[1:] == ["B"] * 4
    assert selection.held_out.count == 50
    assert selection.held_out.scores().max_f == pytest.approx((0.50 + 4 * 0.60) / 5)
    # Ties go to the earlier candidate.
    assert select({"C": [_fold(0.5)] * 3, "D": [_fold(0.5)] * 3}).chosen == ["C"] * 3


def test_paired_difference_by_hand():
    # Two seeds, two folds of 10 images. Seed 0: a - b = +.1 on fold 0, +.3 on fold 1 -> +.2 overall;
    # seed 1: 0 and +.2 -> +.1. Mean +.15, seed sd .0707; fold se: sd(.1, .3) / sqrt 2 = .1 for both seeds.
    a = [[_fold(0.6), _fold(0.8)], [_fold(0.5), _fold(0.7)]]
    b = [[_fold(0.5), _fold(0.5)], [_fold(0.5), _fold(0.5)]]
    d = paired_difference(a, b)
    assert d.mean == pytest.approx(0.15)
    assert d.seed_sd == pytest.approx(np.std([0.2, 0.1], ddof=1))
    assert d.fold_se == pytest.approx(0.1)
    assert paired_difference(a[:1], b[:1]).seed_sd is None
    assert paired_difference(a, b, "mae").mean == pytest.approx(0.0)


def _photo(path, seed):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(synthetic_scene(40, 48, seed=seed)[0]).save(path, quality=90)


def test_a_training_folder_holding_a_dev_image_is_refused(tmp_path):
    dev = tmp_path / "dev"
    for i in (1, 2):
        _photo(dev / f"{i:04d}.jpg", seed=i)
    train = tmp_path / "train"
    for i in range(10, 14):
        _photo(train / f"photo{i}.jpg", seed=i)
    # A file of a dev image's size with other bytes is not that image.
    size = (dev / "0002.jpg").stat().st_size
    (train / "same-size.bin").write_bytes(b"\0" * size)
    check_kept_out([train], dev)
    # A copy under another name in a sub-folder of the second training folder is.
    (train / "sub").mkdir()
    shutil.copy(dev / "0002.jpg", train / "sub" / "renamed.jpg")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DevImageInTrainingError,
                       match=r"--train-images .*train: sub/renamed.jpg is the dev image 0002.jpg"):
        check_kept_out([tmp_path / "empty", train], dev)

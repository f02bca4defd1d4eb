"""`saliency.evaluate.evaluate_folder`: the standard protocol on maps whose scores are known."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from relicv2.saliency.evaluate import evaluate_folder
from relicv2.shards.images import ImageLoadError
from tests.scenes import synthetic_scene


@pytest.fixture
def masks(tmp_path):
    folder = tmp_path / "masks"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(synthetic_scene(30, 40, seed=i)[1]).save(folder / f"m{i}.png")
    return folder


def _maps(tmp_path, masks, name, transform):
    folder = tmp_path / name
    folder.mkdir()
    for path in masks.iterdir():
        Image.fromarray(transform(np.asarray(Image.open(path)))).save(folder / path.name)
    return folder


def test_a_perfect_map_scores_mae_0_and_f_1(tmp_path, masks):
    scores = evaluate_folder(_maps(tmp_path, masks, "perfect", lambda m: m), masks)
    assert (scores.mae, scores.max_f, scores.adaptive_f, scores.count) == (0.0, 1.0, 1.0, 3)


def test_an_inverted_map_scores_badly(tmp_path, masks):
    scores = evaluate_folder(_maps(tmp_path, masks, "inverted", lambda m: 255 - m), masks)
    assert scores.mae == 1.0 and scores.adaptive_f == 0.0
    # Only the threshold that keeps every pixel finds the object: F is then the object's share.
    assert scores.max_f < 0.4


def test_an_unreadable_map_names_its_file(tmp_path, masks):
    maps = _maps(tmp_path, masks, "maps", lambda m: m)
    (maps / "m1.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ImageLoadError, match="m1.png"):
        evaluate_folder(maps, masks)

"""`relicv2 saliency evaluate --model`: a saved model scored on images against masks, and its test-time options."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.saliency import saliency_group
from relicv2.saliency.evaluate import (
    EvaluationError,
    ModelEvaluation,
    evaluate_folder,
    evaluate_model,
)
from relicv2.saliency.images import write_map
from relicv2.saliency.network.model_file import load_model
from relicv2.saliency.network.predictor import predict_map, with_maps
from tests.scenes import synthetic_scene


@pytest.fixture
def labelled(tmp_path):
    """Three generated scenes (JPEG) and their masks (PNG), named alike."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    for i in range(3):
        rgb, mask = synthetic_scene(40 + 4 * i, 56, seed=i)
        Image.fromarray(rgb).save(images / f"img{i}.jpg", quality=95)
        Image.fromarray(mask).save(masks / f"img{i}.png")
    return images, masks


def _invoke(args):
    return CliRunner().invoke(saliency_group, ["evaluate", *args])


def test_a_model_scores_what_its_written_maps_score(tiny_model, labelled, tmp_path):
    images, masks = labelled
    model, info = load_model(tiny_model)
    maps = tmp_path / "written"
    for path in sorted(images.iterdir()):
        write_map(maps / f"{path.stem}.png", predict_map(model, np.asarray(Image.open(path)), info["input_size"]))
    direct = evaluate_model(ModelEvaluation(model=tiny_model, images=images, gt=masks))
    assert direct == evaluate_folder(maps, masks)
    assert direct.count == 3
    # The output folder of `saliency train` names the same model.
    assert evaluate_model(ModelEvaluation(model=tiny_model.parent, images=images, gt=masks)) == direct


def test_flip_averaging_is_mirror_equivariant(tiny_model):
    model, info = load_model(tiny_model)
    rgb, _ = synthetic_scene(40, 56, seed=3)
    size = info["input_size"]
    plain, averaged = predict_map(model, rgb, size), predict_map(model, rgb, size, flip=True)
    mirrored = predict_map(model, np.ascontiguousarray(rgb[:, ::-1]), size, flip=True)
    assert averaged.shape == rgb.shape[:2]
    np.testing.assert_allclose(mirrored[:, ::-1], averaged, atol=1e-5)
    assert not np.allclose(plain, averaged, atol=1e-3)  # a random network is not mirror-symmetric


def test_the_mean_with_perfect_maps_lifts_a_random_model(tiny_model, labelled, tmp_path):
    images, masks = labelled
    maps = tmp_path / "handcrafted"
    (maps / "rbd").mkdir(parents=True)
    for path in masks.iterdir():  # a "method" whose maps are the ground truth
        (maps / "rbd" / path.name).write_bytes(path.read_bytes())
    alone = evaluate_model(ModelEvaluation(model=tiny_model, images=images, gt=masks))
    mixed = evaluate_model(ModelEvaluation(model=tiny_model, images=images, gt=masks, maps=maps))
    assert mixed.max_f > 0.99 > alone.max_f
    assert mixed.mae < alone.mae
    with pytest.raises(ValueError, match="differ in size"):
        with_maps(np.zeros((4, 4)), np.zeros((4, 5)))
    with pytest.raises(EvaluationError, match="holds no map folder"):
        evaluate_model(ModelEvaluation(model=tiny_model, images=images, gt=masks, maps=tmp_path))


def test_cli_scores_a_model(tiny_model, labelled):
    images, masks = labelled
    result = _invoke(["--model", str(tiny_model), "--images", str(images), "--gt", str(masks), "--flip",
                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert f"| {tiny_model} |" in result.output and "| 3 |" in result.output


def test_cli_crf_refines_the_maps_it_scores(tiny_model, labelled, tmp_path):
    pytest.importorskip("pydensecrf.densecrf", reason="the CRF needs pydensecrf2 (requirements.lock)")
    images, masks = labelled
    scores = {}
    for flag in ([], ["--crf"]):
        result = _invoke(["--model", str(tiny_model), "--images", str(images), "--gt", str(masks), "--device", "cpu",
                          "--json", str(tmp_path / "scores.json"), *flag])
        assert result.exit_code == 0, result.output
        scores[bool(flag)] = (tmp_path / "scores.json").read_text()
    assert scores[True] != scores[False]


@pytest.mark.parametrize("args, message", [
    ([], "give either --pred"),
    (["--pred", "X", "--model", "Y"], "give either --pred"),
    (["--model", "Y"], "--model needs --images"),
    (["--pred", "X", "--flip"], "go with --model"),
    (["--pred", "X", "--crf"], "go with --model"),
])
def test_cli_refuses_mixed_options(args, message):
    result = _invoke([*args, "--gt", "G"])
    assert result.exit_code == 2 and message in result.output


def test_cli_bad_inputs_are_one_line(tiny_model, labelled, tmp_path):
    images, masks = labelled

    def run(model=tiny_model, folder=images, gt=masks):
        result = _invoke(["--model", str(model), "--images", str(folder), "--gt", str(gt), "--device", "cpu"])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        return result.output

    foreign = tmp_path / "foreign.pt"
    foreign.write_bytes(b"not a model")
    assert "not a readable saliency model file" in run(model=foreign)
    assert "does not exist" in run(folder=tmp_path / "nope")
    # Nothing to score: no image has a mask of its name.
    others = tmp_path / "others"
    others.mkdir()
    Image.fromarray(np.zeros((40, 56), np.uint8)).save(others / "zzz.png")
    assert "no file in" in run(gt=others)
    # A mask of another size than its image.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for path in masks.iterdir():
        Image.open(path).resize((20, 20)).save(wrong / path.name)
    assert "is 56x40 but its mask" in run(gt=wrong)
    # An image that cannot be read.
    (images / "img1.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    assert "img1.jpg" in run()

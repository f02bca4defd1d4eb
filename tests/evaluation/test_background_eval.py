"""`relicv2 eval backgrounds` on crafted sets: an encoder and head trained where the background carries the class
lose mixed-rand and show a BG-gap; where the object carries it, the variants keeping the object stay right. The
variant set follows the seed, counts what it leaves out, resumes; bad inputs are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import relicv2.evaluation.background_eval as background_eval
import relicv2.evaluation.background_set as background_set
from relicv2.cli.eval import eval_group
from relicv2.evaluation.background_eval import BackgroundsConfig, evaluate_backgrounds
from relicv2.evaluation.background_set import VariantSettings, build_variant_set, variant_tars
from relicv2.evaluation.backgrounds import MIXED, VARIANTS
from relicv2.evaluation.head_file import TRAINED_HEAD_FILE
from relicv2.evaluation.linear import LinearConfig, evaluate_linear
from relicv2.pretrain.checkpoint import random_encoder
from relicv2.shards import ShardSample, read_rejected, write_shard_set
from relicv2.shards.job import sha256_of
from tests.evaluation.backdrops import SIZE, encoded, write_crafted_set

HEAD = LinearConfig(protocol="fast", epochs=30, batch_size=16, crop_size=SIZE, resize_size=SIZE)
QUIET = {"progress": False, "log": lambda text: None}


class Killed(Exception):
    """A job killed part-way (raised by a patched step)."""


class Pixels(nn.Module):
    """A fixed encoder: the view average-pooled to 8 x 8 (192 features); the head learns what carries the class."""

    num_features = 192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(x, 8).flatten(1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per carrier ("background", "foreground"): (root, val set with masks, head file of a Pixels encoder)."""
    sets = {}
    for carried_by in ("background", "foreground"):
        root = tmp_path_factory.mktemp(carried_by)
        write_crafted_set(root / "train", carried_by, seed=1, masks=False)
        write_crafted_set(root / "val", carried_by, seed=2)
        evaluate_linear(Pixels(), root / "train", root / "val", HEAD, output_dir=root / "linear")
        sets[carried_by] = root, root / "val", root / "linear" / TRAINED_HEAD_FILE
    return sets


def test_where_the_background_carries_the_class_mixed_rand_falls_to_chance(trained, tmp_path):
    _, val, head = trained["background"]
    result = evaluate_backgrounds(Pixels(), head, val, None, tmp_path, BackgroundsConfig(), **QUIET)
    accuracy = result["accuracy"]
    assert result["images"] == result["num_val"] == 90 and result["excluded"] == {}
    assert accuracy["original"] > 0.95 and accuracy["mixed_same"] > 0.9 and accuracy["only_bg_t"] > 0.9
    assert accuracy["mixed_rand"] < 0.5 and accuracy["mixed_next"] < 0.1  # chance is 1/3; next is never right
    assert result["bg_gap"] > 0.45 and accuracy["only_fg"] < 0.6
    assert result["follows_background"]["mixed_rand"] > 0.9 and result["follows_background"]["mixed_next"] > 0.9
    assert json.loads((tmp_path / "backgrounds.json").read_text()) == json.loads(json.dumps(result))


def test_where_the_object_carries_the_class_the_variants_keeping_it_stay_right(trained, tmp_path):
    _, val, head = trained["foreground"]
    result = evaluate_backgrounds(Pixels(), head, val, None, tmp_path, BackgroundsConfig(), **QUIET)
    accuracy = result["accuracy"]
    for name in ("original", "only_fg", "mixed_same", "mixed_rand", "mixed_next"):
        assert accuracy[name] > 0.9, (name, accuracy)
    assert abs(result["bg_gap"]) < 0.1 and result["follows_background"]["mixed_rand"] < 0.1
    assert accuracy["no_fg"] < 0.6 and accuracy["only_bg_b"] < 0.6


def _tar_digests(folder, names=VARIANTS):
    return {name: [sha256_of(tar) for tar in variant_tars(folder, name)] for name in names}


def test_the_variant_set_follows_the_seed(trained, tmp_path):
    _, val, _ = trained["background"]
    for folder, seed in (("a", 3), ("b", 3), ("c", 4)):
        build_variant_set(val, None, tmp_path / folder, VariantSettings(seed, SIZE, SIZE, images_per_shard=40),
                          progress=False)
    first, again, other = (_tar_digests(tmp_path / f) for f in "abc")
    assert first == again and all(len(tars) == 3 for tars in first.values())  # 90 images, 40 a shard
    assert all(first[name] == other[name] for name in VARIANTS if name not in MIXED)
    assert all(first[name] != other[name] for name in MIXED)


def test_images_without_a_usable_mask_are_left_out_counted_and_listed(trained, tmp_path):
    _, val, head = trained["background"]
    masks = write_crafted_set(tmp_path / "again", "background", seed=2)  # the val set's masks, by key
    folder = tmp_path / "masks"
    folder.mkdir()
    keys = sorted(masks)
    for number, key in enumerate(keys[:-1]):  # the last image has no mask
        mask = masks[key]
        if number < 4:  # under the masking's 5% minimum
            mask = np.zeros_like(mask)
            mask[:2, :2] = 255
        elif number < 7:  # the object's box over 90% of the view
            mask = mask.copy()
            mask[0, 0] = mask[-1, -1] = 255
        (folder / f"{key}.png").write_bytes(encoded(mask))
    (folder / "stranger.png").write_bytes(encoded(masks[keys[0]]))  # a mask of no image: ignored
    result = evaluate_backgrounds(Pixels(), head, tmp_path / "again", folder, tmp_path / "out", BackgroundsConfig(),
                                  **QUIET)
    assert result["excluded"] == {"large_box": 3, "no_mask": 1, "small_mask": 4}
    assert result["images"] == 82 and set(result["num_images"].values()) == {82}
    listed = read_rejected(tmp_path / "out" / "variants").to_pylist()
    assert sorted((row["source"], row["reason"]) for row in listed) == sorted(
        [(k, "small_mask") for k in keys[:4]] + [(k, "large_box") for k in keys[4:7]] + [(keys[-1], "no_mask")])


def test_masks_beside_the_images_give_the_same_test(trained, tmp_path):
    _, val, head = trained["background"]
    write_crafted_set(tmp_path / "plain", "background", seed=2, masks=False)  # the same images, keys, no masks
    inside = evaluate_backgrounds(Pixels(), head, val, None, tmp_path / "a", BackgroundsConfig(), **QUIET)
    beside = evaluate_backgrounds(Pixels(), head, tmp_path / "plain", val, tmp_path / "b", BackgroundsConfig(), **QUIET)
    assert beside["accuracy"] == inside["accuracy"] and beside["images"] == 90
    assert _tar_digests(tmp_path / "a" / "variants") == _tar_digests(tmp_path / "b" / "variants")


@pytest.fixture(scope="module")
def resnet_head(trained):
    """A head file for a random-init ResNet-18 (seed 0: what `--random-init 18` loads), on the background set."""
    root, val, _ = trained["background"]
    evaluate_linear(random_encoder(18, seed=0), root / "train", val, HEAD, output_dir=root / "linear18")
    return val, root / "linear18" / TRAINED_HEAD_FILE


def _backgrounds(*args: str):
    return CliRunner().invoke(eval_group, ["backgrounds", "--random-init", "18", "--device", "cpu", *args])


def test_an_interrupted_run_resumes_to_the_same_json(resnet_head, tmp_path, monkeypatch):
    val, head = resnet_head
    common = ["--head", str(head), "--val", str(val), "--set", "images_per_shard=50"]
    whole = _backgrounds(*common, "--output", str(tmp_path / "whole"))
    assert whole.exit_code == 0, whole.output
    assert "BG-gap (mixed_same - mixed_rand)" in whole.stdout
    out = tmp_path / "cut"
    composed, real_variant = [], background_set.variant

    def variant_then_stop(*args, **kwargs):  # killed in the second chunk's composites
        composed.append(args[0])
        if len(composed) == 8 * 50 + 20:
            raise Killed
        return real_variant(*args, **kwargs)

    monkeypatch.setattr(background_set, "variant", variant_then_stop)
    assert isinstance(_backgrounds(*common, "--output", str(out)).exception, Killed)
    monkeypatch.setattr(background_set, "variant", real_variant)
    scored, real_score = [], background_eval.score_head

    def score_then_stop(*args, **kwargs):  # killed while scoring the fourth variant
        scored.append(args[2])
        if len(scored) == 4:
            raise Killed
        return real_score(*args, **kwargs)

    monkeypatch.setattr(background_eval, "score_head", score_then_stop)
    second = _backgrounds(*common, "--output", str(out))
    assert isinstance(second.exception, Killed), second.output
    monkeypatch.setattr(background_eval, "score_head", real_score)
    composed.clear()
    monkeypatch.setattr(background_set, "variant", variant_then_stop)
    resumed = _backgrounds(*common, "--output", str(out), "--json", str(tmp_path / "result.json"))
    assert resumed.exit_code == 0, resumed.output
    assert composed == []  # the variant set was finished: nothing composed again
    assert _tar_digests(out / "variants") == _tar_digests(tmp_path / "whole" / "variants")
    assert (tmp_path / "result.json").read_text() == (tmp_path / "whole" / "backgrounds.json").read_text()
    assert (out / "backgrounds.json").read_text() == (tmp_path / "whole" / "backgrounds.json").read_text()


def test_bad_inputs_are_one_line(resnet_head, trained, tmp_path):
    val, head = resnet_head
    root = trained["background"][0]
    strangers = tmp_path / "strangers"  # masks keyed unlike the images
    write_shard_set([ShardSample(f"other{i}", {"png": encoded(np.zeros((8, 8, 3), np.uint8)),
                                               "mask.png": encoded(np.full((8, 8), 255, np.uint8))}) for i in range(3)],
                    strangers)
    squashed = tmp_path / "squashed"  # masks of another shape than their images
    squashed.mkdir()
    for i in range(90):
        (squashed / f"c{i // 30}n{i:03d}.png").write_bytes(encoded(np.full((8, 32), 255, np.uint8)))
    square = np.zeros((SIZE, SIZE), np.uint8)
    square[10:22, 10:22] = 255
    write_shard_set([ShardSample(f"b{i}", {"png": encoded(np.full((SIZE, SIZE, 3), 90 * i, np.uint8)),
                                           "mask.png": encoded(square)}, label=7) for i in range(3)], tmp_path / "beyond")
    cases = {
        "class index 7, beyond the 3 classes": ["--val", str(tmp_path / "beyond")],
        "mask_shape": ["--val", str(root / "train"), "--masks", str(squashed)],
        "holds no masks (mask.png members); build them with `relicv2 saliency build-masks":
            ["--val", str(root / "train")],
        "no image of": ["--val", str(val), "--masks", str(strangers)],
        "was trained on another encoder": ["--val", str(val), "--seed", "1"],
        "unknown key colour": ["--val", str(val), "--set", "colour=red"],
    }
    for words, args in cases.items():
        result = _backgrounds("--head", str(head), "--output", str(tmp_path / "out"), *args)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]  # besides progress lines
        assert result.exit_code != 0 and len(errors) == 1 and words in errors[0], (words, result.output)
        assert "Traceback" not in result.output

"""`saliency build-masks --crf` and `saliency evaluate --crf`: each mask is the model's map refined by the dense CRF
it was trained with, on the image the network saw, also when rejected samples leave gaps in a batch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.main import cli
from relicv2.jobs.config import ConfigError
from relicv2.saliency.network.build_masks import (
    STATE_DIR,
    BuildMasksConfig,
    MasksError,
    build_masks,
)
from relicv2.saliency.network.config import CrfConfig, load_saliency_config
from relicv2.saliency.network.crf import model_crf
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import load_model, save_model
from relicv2.saliency.network.predictor import predict_map
from relicv2.shards import ReadReport, ShardSample, iter_samples, write_shard_set
from relicv2.shards.build import Ranks
from relicv2.shards.job import PLAN_NAME
from tests.saliency.network.conftest import SquarePredictor
from tests.scenes import synthetic_scene

pytest.importorskip("pydensecrf.densecrf", reason="the CRF needs pydensecrf2 (requirements.lock)")

SIZE = 48


def _sharp_model(path: Path, config: dict | None = None) -> Path:
    """A random network whose map is sharpened so that the CRF has a foreground to work on."""
    torch.manual_seed(0)
    net = SaliencyNet(18).eval()
    with torch.no_grad():
        net.fuse[-1].weight.mul_(200.0)
    return save_model(path, net, input_size=SIZE, preset="tiny", backbone="random initialisation",
                      config=config if config is not None else {"crf": {"iterations": 3}}, report={})


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, "PNG")
    return buffer.getvalue()


def _scenes() -> dict[str, np.ndarray]:
    return {f"scene{i}": synthetic_scene(40 + 8 * i, 64, seed=i)[0] for i in range(5)}


def _config(model: Path, shards: Path, out: Path, **kw) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=2, batch_size=3, progress=False, **kw)


def _masks(out: Path) -> dict[str, np.ndarray]:
    return {s["key"]: np.asarray(Image.open(io.BytesIO(s["mask.png"])), np.int16)
            for s in iter_samples(out, report=ReadReport())}


def test_each_mask_is_the_crf_of_its_own_image_with_gaps_in_the_batch(tmp_path) -> None:
    """Undecodable samples between good ones leave their places in the batch's slot empty: each kept
    sample's map must be refined on its own image, as `predict_map(..., crf=)` does one image at a time."""
    model = _sharp_model(tmp_path / "sharp.pt")
    scenes = _scenes()
    samples = []
    for i, (key, rgb) in enumerate(scenes.items()):
        samples.append(ShardSample(key, {"png": _png(rgb)}, i, {}))
        if i in (0, 2):  # a gap at the second place of the first batch and the first of the second
            samples.append(ShardSample(f"broken{i}", {"png": b"\x89PNG not an image"}, i, {}))
    write_shard_set(samples, tmp_path / "in", max_count=len(samples))
    summary = build_masks(_config(model, tmp_path / "in", tmp_path / "out", crf=True), Ranks())
    assert (summary["written"], summary["rejected"]) == (5, 2)
    masks = _masks(tmp_path / "out")
    network, info = load_model(model)
    crf = model_crf(info, str(model))
    assert crf.iterations == 3 and crf.reference_size == SIZE  # the file's CRF, at the model's size
    plain = _masks_without_crf(model, tmp_path)
    for key, rgb in scenes.items():
        expected = np.rint(np.clip(predict_map(network, rgb, SIZE, crf=crf) * 255, 0, 255))
        assert np.abs(masks[key] - expected).mean() < 0.5, key
        assert np.abs(masks[key] - plain[key]).mean() > 5, key  # the CRF did change the mask


def _masks_without_crf(model: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    out = tmp_path / "plain"
    build_masks(_config(model, tmp_path / "in", out), Ranks())
    return _masks(out)


def test_a_rerun_with_another_crf_setting_is_refused_and_the_plan_without_it_is_unchanged(
        tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    plain, refined = tmp_path / "plain", tmp_path / "refined"
    build_masks(_config(tiny_model, shards, plain), Ranks(), predictor=SquarePredictor())
    assert "crf" not in json.loads((plain / STATE_DIR / PLAN_NAME).read_text())
    with pytest.raises(MasksError, match="crf setting"):
        build_masks(_config(tiny_model, shards, plain, crf=True), Ranks(), predictor=SquarePredictor())
    build_masks(_config(tiny_model, shards, refined, crf=True), Ranks(), predictor=SquarePredictor())
    assert json.loads((refined / STATE_DIR / PLAN_NAME).read_text())["crf"] is True
    assert json.loads((refined / "info.json").read_text())["crf"] is True
    with pytest.raises(MasksError, match="crf setting"):
        build_masks(_config(tiny_model, shards, refined), Ranks(), predictor=SquarePredictor())


def test_a_model_file_with_crf_settings_no_crf_takes_is_refused_in_one_line(tmp_path, scene_shards) -> None:
    shards, _ = scene_shards
    model = _sharp_model(tmp_path / "odd.pt", config={"crf": {"radius": 3}})
    with pytest.raises(MasksError, match=r"odd\.pt.*crf\.radius") as refused:
        build_masks(_config(model, shards, tmp_path / "out", crf=True), Ranks())
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()  # refused before the output folder is made
    build_masks(_config(model, shards, tmp_path / "out"), Ranks())  # without --crf the section is not read


def test_model_crf_takes_the_defaults_where_the_file_records_none() -> None:
    assert model_crf({"input_size": 112}, "m.pt") == CrfConfig().at_size(112)
    assert model_crf({"input_size": 64, "config": {"crf": {"bilateral_srgb": 5}}}, "m.pt").bilateral_srgb == 5.0
    with pytest.raises(ConfigError, match="m.pt: crf.iterations"):
        model_crf({"input_size": 64, "config": {"crf": {"iterations": "five"}}}, "m.pt")


@pytest.mark.parametrize("setting", ["iterations=-1", "gaussian_sxy=-3", "bilateral_sxy=0", "bilateral_srgb=-1",
                                     "gaussian_compat=-1"])
def test_impossible_crf_settings_are_refused_by_train_and_in_a_model_file(setting) -> None:
    key, value = setting.split("=")
    with pytest.raises(ConfigError, match=rf"crf\.{key} must be"):
        load_saliency_config("tiny", [f"crf.{setting}"])
    with pytest.raises(ConfigError, match=rf"m\.pt: crf\.{key} must be"):
        model_crf({"input_size": 64, "config": {"crf": {key: float(value)}}}, "m.pt")


def test_the_cli_flag_lands_in_the_saved_settings(tmp_path, scene_shards) -> None:
    shards, _ = scene_shards
    model = _sharp_model(tmp_path / "sharp.pt")
    out = tmp_path / "masked"
    result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(model), "--shards", str(shards),
                                      "--out", str(out), "--config", "cpu", "--workers", "0", "--no-progress",
                                      "--crf"])
    assert result.exit_code == 0, result.output
    assert "crf: true" in (out / "config.yaml").read_text()
    assert json.loads((out / "info.json").read_text())["crf"] is True

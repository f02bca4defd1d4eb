"""Refinement moves labels towards the truth; `saliency train` checkpoints, resumes exactly and reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

import relicv2.saliency.network.train as train_module
from relicv2.jobs.atomic import TEMP_MARK
from relicv2.models.torchfile import TorchFileError
from relicv2.saliency.images import write_png
from relicv2.saliency.network.config import load_saliency_config
from relicv2.saliency.network.data import TrainingImages, load_training_images
from relicv2.saliency.network.model_file import load_model
from relicv2.saliency.network.train import Trainer, TrainJob, TrainStateError, run_train
from relicv2.shards import write_shard_set
from tests.saliency.network.conftest import scene_samples
from tests.scenes import synthetic_scene


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max((a | b).sum(), 1))


def _noisy_map(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A handcrafted-like map: the object blurred and shifted, plus a false blob and noise."""
    shifted = np.roll(mask.astype(np.float32) / 255.0, (3, 4), axis=(0, 1))
    blob = np.zeros_like(shifted)
    cv2.circle(blob, (int(rng.integers(4, 10)), int(rng.integers(4, 10))), 4, 1.0, -1)
    noisy = cv2.GaussianBlur(shifted, (0, 0), 2.0) * 0.8 + blob * 0.6 + rng.uniform(0, 0.25, shifted.shape)
    return np.clip(noisy, 0, 1).astype(np.float32)


def test_one_refinement_iteration_moves_labels_towards_the_masks(tmp_path: Path) -> None:
    size, count = 32, 8
    rng = np.random.default_rng(0)
    images, maps, masks = [], [], []
    for i in range(count):
        rgb, mask = synthetic_scene(size, size, seed=i)
        images.append(torch.from_numpy(rgb).permute(2, 0, 1))
        maps.append(torch.from_numpy(_noisy_map(mask, rng)).half())
        masks.append(mask > 0)
    data = TrainingImages([f"s{i}" for i in range(count)], torch.stack(images), {"rbd": torch.stack(maps)})
    config = load_saliency_config("tiny", ["methods=rbd", "input_size=32", "epochs=4", "average_keep=0.5",
                                           "lr=0.001", "thresholds.rbd=0.3"])
    job = TrainJob(shards=tmp_path, out=tmp_path / "out", config=config, backbone="random", progress=False)
    trainer = Trainer(job, data, None)
    try:
        trainer.run_unit(train_module.plan_units(config)[0])
    finally:
        trainer.crf.close()
    refined = trainer.result("rbd-it1").float().numpy() >= 0.5
    raw = [m.float().numpy() >= 0.3 for m in data.maps["rbd"]]
    before = np.mean([_iou(r, m) for r, m in zip(raw, masks, strict=True)])
    after = np.mean([_iou(r, m) for r, m in zip(refined, masks, strict=True)])
    assert after > before + 0.05, (before, after)


def test_no_phase_one_fits_the_fused_network_to_the_maps_labels(tmp_path: Path, scene_shards, gt_folder) -> None:
    shards, _ = scene_shards
    config = load_saliency_config("tiny", ["methods=mc,rbd", "num_images=4", "iterations=0", "fuse_epochs=2"])
    assert [u.name for u in train_module.plan_units(config)] == ["fused"]
    job = TrainJob(shards=shards, out=tmp_path / "out", config=config, backbone="random", gt=gt_folder,
                   progress=False)
    report = run_train(job, log=lambda _: None)
    assert set(report["losses"]) == {"fused"} and len(report["losses"]["fused"]) == 2
    assert sorted(p.name for p in (tmp_path / "out" / "work").iterdir()) == ["fused.done.pt"]
    rows = report["train"]
    assert {"mean of binarised maps", "fused network"} <= set(rows) and not any("refined" in r for r in rows)
    # What it fitted: each method's map at that method's first-round threshold.
    trainer = Trainer(job, load_training_images(
        shards, tmp_path / "out", count=4, seed=config.seed, size=config.input_size, methods=config.methods,
        workers=0, progress=False), None)
    labels = trainer.fused_labels()
    for j, m in enumerate(config.methods):
        assert torch.equal(labels[:, j].bool(), trainer.data.maps[m].float() >= config.thresholds[m]), m


def test_an_epochs_crf_runs_in_the_workers_while_the_next_epoch_trains(tmp_path: Path, monkeypatch) -> None:
    """Phase I's CRF of epoch e overlaps the training of epoch e + 1, and the labels are still the moving
    average of every epoch's CRF in epoch order."""
    from relicv2.saliency.network import crf as crf_module

    size, count, epochs = 32, 6, 3
    images, maps = [], []
    for i in range(count):
        rgb, mask = synthetic_scene(size, size, seed=i)
        images.append(torch.from_numpy(rgb).permute(2, 0, 1))
        maps.append(torch.from_numpy(mask.astype(np.float32) / 255.0).half())
    data = TrainingImages([f"s{i}" for i in range(count)], torch.stack(images), {"rbd": torch.stack(maps)})
    config = load_saliency_config("tiny", ["methods=rbd", "input_size=32", f"epochs={epochs}", "average_keep=0.5",
                                           "workers=2"])
    events, submitted = [], []
    real_epoch, real_submit, real_result = train_module.train_epoch, crf_module.CrfPool.submit, crf_module.Refinement.result

    def epoch(*args, **kwargs):
        events.append("train")
        return real_epoch(*args, **kwargs)

    def submit(pool, probabilities):
        events.append("crf submitted")
        submitted.append(probabilities.copy())
        return real_submit(pool, probabilities)

    def result(refinement):
        events.append("crf awaited")
        return real_result(refinement)

    monkeypatch.setattr(train_module, "train_epoch", epoch)
    monkeypatch.setattr(crf_module.CrfPool, "submit", submit)
    monkeypatch.setattr(crf_module.Refinement, "result", result)
    job = TrainJob(shards=tmp_path, out=tmp_path / "out", config=config, backbone="random", progress=False)
    trainer = Trainer(job, data, None)
    with trainer.crf:
        trainer.run_unit(train_module.plan_units(config)[0])
    assert trainer.crf.pool is None  # closed by the with block
    assert events == ["train", "crf submitted"] + ["train", "crf awaited", "crf submitted"] * (epochs - 1) + [
        "crf awaited"]
    expected = np.zeros((count, size, size), dtype=np.float32)
    rgb = data.images.permute(0, 2, 3, 1).numpy()
    crf = config.crf.at_size(size)
    for predictions in submitted:
        refined = np.stack([crf_module.dense_crf(rgb[i], p, crf) for i, p in enumerate(predictions)])
        expected = 0.5 * expected + 0.5 * refined
    assert torch.equal(trainer.result("rbd-it1"), torch.from_numpy(expected).half())


@pytest.fixture
def held_back(tmp_path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """Four other scenes in two plain tars, named by a brace pattern (no manifest, no index)."""
    samples, masks = scene_samples(4, start=12)
    write_shard_set(samples, tmp_path / "held", max_count=2)
    for extra in [*(tmp_path / "held").glob("*.idx"), *(tmp_path / "held").glob("*.parquet")]:
        extra.unlink()
    names = sorted(p.name for p in (tmp_path / "held").glob("*.tar"))
    assert len(names) == 2
    stem, first, last = names[0].rsplit("-", 1)[0], names[0].rsplit("-", 1)[1][:-4], names[1].rsplit("-", 1)[1][:-4]
    return str(tmp_path / "held" / f"{stem}-{{{first}..{last}}}.tar"), masks


@pytest.fixture
def gt_folder(tmp_path: Path, scene_shards, held_back) -> Path:
    folder = tmp_path / "gt"
    for key, mask in {**scene_shards[1], **held_back[1]}.items():
        write_png(folder / f"{key}.png", mask)
    return folder


def _job(shards: Path, out: Path, gt: Path | None = None, eval_shards: str | None = None) -> TrainJob:
    config = load_saliency_config("tiny", ["methods=mc", "num_images=4", "epochs=2", "fuse_epochs=2"])
    return TrainJob(shards=shards, out=out, config=config, backbone="random", gt=gt, eval_shards=eval_shards,
                    progress=False)


class _Killed(Exception):
    pass


def _killed_one_epoch_into_mc(monkeypatch) -> None:
    """`run_train` of `_job` killed in mc-it1's second epoch (its first one's work file written)."""
    real_epoch, calls = train_module.train_epoch, {"n": 0}

    def dying_epoch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise _Killed
        return real_epoch(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_epoch", dying_epoch)


def test_train_resumes_after_a_kill_to_the_same_model(tmp_path: Path, scene_shards, gt_folder, held_back,
                                                     monkeypatch) -> None:
    shards, _ = scene_shards
    # held-back images named by a brace pattern
    run_train(_job(shards, tmp_path / "whole", gt_folder, eval_shards=held_back[0]), log=lambda _: None)
    whole, info = load_model(tmp_path / "whole" / "model.pt")
    report = json.loads((tmp_path / "whole" / "report.json").read_text())
    assert info["input_size"] == 32 and info["preset"] == "tiny" and info["arch"]["depth"] == 18
    assert report["images"] == 4 and set(report["losses"]) == {"mc-it1", "fused"}
    rows = report["train"]
    assert {"mc raw map", "mc refined it1", "mean of refined labels", "mean of handcrafted", "fused network"} <= set(rows)
    assert all(r["count"] == 4 and 0 <= r["mae"] <= 1 for r in rows.values())
    held = report["heldout"]
    assert set(held) == {"mc raw map", "mean of handcrafted", "fused network"}
    assert all(r["count"] == 4 and 0 <= r["mae"] <= 1 for r in held.values())  # every held-back image scored

    real_epoch = train_module.train_epoch
    _killed_one_epoch_into_mc(monkeypatch)
    with pytest.raises(_Killed):
        run_train(_job(shards, tmp_path / "resumed", gt_folder), log=lambda _: None)
    work = tmp_path / "resumed" / "work"
    assert (work / "mc-it1.current.pt").is_file() and not (work / "mc-it1.done.pt").exists()
    # what a kill -9 in the middle of a save leaves (the writer's own cleanup never ran), and a user's file
    torn, users = work / f".mc-it1.current.pt{TEMP_MARK}host-4242", work / ".notes"  # a killed process's name
    torn.write_bytes(b"half a checkpoint")
    users.write_text("mine")
    monkeypatch.setattr(train_module, "train_epoch", real_epoch)
    run_train(_job(shards, tmp_path / "resumed", gt_folder), log=lambda _: None)
    assert not torn.exists() and users.read_text() == "mine"  # the rerun removes only what a run wrote
    resumed, _ = load_model(tmp_path / "resumed" / "model.pt")
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert json.loads((tmp_path / "resumed" / "report.json").read_text())["train"] == rows


def test_a_work_file_whose_pending_predictions_do_not_fit_is_one_error_naming_it(tmp_path: Path, scene_shards,
                                                                               monkeypatch) -> None:
    shards, _ = scene_shards
    real_epoch = train_module.train_epoch
    _killed_one_epoch_into_mc(monkeypatch)
    with pytest.raises(_Killed):
        run_train(_job(shards, tmp_path / "out"), log=lambda _: None)
    current = tmp_path / "out" / "work" / "mc-it1.current.pt"
    state = train_module.CURRENT.load(current)
    assert state["pending"].shape == state["average"].shape  # the killed epoch's CRF was not yet averaged
    train_module.CURRENT.save(current, {**state, "pending": state["pending"][:2]})
    monkeypatch.setattr(train_module, "train_epoch", real_epoch)
    with pytest.raises(TorchFileError, match="pending predictions") as refused:
        run_train(_job(shards, tmp_path / "out"), log=lambda _: None)
    assert str(current) in str(refused.value) and "delete it" in str(refused.value)


def test_other_settings_in_the_same_folder_are_refused(tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards
    job = _job(shards, tmp_path / "out")
    (tmp_path / "out" / "work").mkdir(parents=True)  # an earlier run got past its checks
    (tmp_path / "out" / "config.yaml").write_text(
        yaml.safe_dump({"epochs": 1, "inputs": {"shards": "nope", "backbone": "random"}}))
    with pytest.raises(TrainStateError, match=f"shards: nope there, {shards} now") as refused:
        run_train(dataclasses.replace(job), log=lambda _: None)
    assert "epochs: 1 there, 2 now" in str(refused.value) and "backbone" not in str(refused.value)

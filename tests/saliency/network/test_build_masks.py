"""`saliency build-masks`: round trip, coverage, kill-resume byte equality, two ranks, hostile keys, EXIF,
and the masked set feeding the pretraining view loader."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relicv2.saliency.network.build_masks import (
    STATE_DIR,
    BuildMasksConfig,
    MasksError,
    build_masks,
)
from relicv2.shards import (
    ReadReport,
    ShardSample,
    iter_samples,
    read_manifest,
    read_rejected,
    write_index,
    write_shard_set,
)
from relicv2.shards.build import Ranks
from relicv2.shards.index import index_path
from relicv2.shards.job import PLAN_NAME
from tests.exif_images import orientation6_jpeg
from tests.saliency.network.conftest import SquarePredictor, jpeg_bytes, scene_samples
from tests.scenes import synthetic_scene


def _config(model: Path, shards: Path, out: Path, **kw) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=2, batch_size=3, progress=False, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    """The masked set's files (config.yaml names the job's own folder and settings: left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "config.yaml"}


def test_round_trip_keeps_jpeg_bytes_and_gets_coverage_right(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    summary = build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks(), predictor=SquarePredictor())
    assert summary["written"] == 12 and summary["rejected"] == 0
    originals = {s["key"]: s for s in iter_samples(shards, report=ReadReport())}
    masked = list(iter_samples(tmp_path / "out", report=ReadReport()))
    assert sorted(s["key"] for s in masked) == sorted(originals)
    for sample in masked:
        source = originals[sample["key"]]
        assert sample["jpg"] == source["jpg"]  # copied, never re-encoded
        assert sample["label"] == source["label"]
        mask = np.asarray(Image.open(io.BytesIO(sample["mask.png"])))
        assert mask.shape == (48, 64) and mask.dtype == np.uint8
        # The centre square of half the side covers a quarter of the image.
        assert sample["meta"]["mask_coverage"] == pytest.approx(0.25, abs=0.03)
        assert sample["meta"]["mask_status"] == "ok"
    manifest = read_manifest(tmp_path / "out").to_pylist()
    assert len(manifest) == 12 and all(abs(r["mask_coverage"] - 0.25) < 0.03 for r in manifest)
    assert sorted(p.name for p in (tmp_path / "out").glob("masked-*.tar")) == [
        "masked-000000.tar", "masked-000001.tar", "masked-000002.tar"]


def test_real_model_file_runs(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    summary = build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks())
    assert summary["written"] == 12
    assert sum(summary["coverage_histogram"]) == 12


class _Killed(Exception):
    pass


class _DiesOnSecondShard(SquarePredictor):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, squares):
        self.calls += 1
        if self.calls == 3:  # shard 0 takes two batches of 3 and 1; die inside shard 1
            raise _Killed
        return super().__call__(squares)


def test_kill_and_resume_is_byte_identical(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    build_masks(_config(tiny_model, shards, tmp_path / "whole"), Ranks(), predictor=SquarePredictor())
    with pytest.raises(_Killed):
        build_masks(_config(tiny_model, shards, tmp_path / "resumed"), Ranks(), predictor=_DiesOnSecondShard())
    assert (tmp_path / "resumed" / "masked-000000.tar").is_file()
    assert not (tmp_path / "resumed" / "masked-000001.tar").exists()
    kept = (tmp_path / "resumed" / "masked-000000.tar").stat().st_mtime_ns
    build_masks(_config(tiny_model, shards, tmp_path / "resumed"), Ranks(), predictor=SquarePredictor())
    assert (tmp_path / "resumed" / "masked-000000.tar").stat().st_mtime_ns == kept  # finished shard kept
    assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")
    assert not list((tmp_path / "resumed").glob(".*tmp-*"))


def test_two_ranks_split_without_overlap_or_loss(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "out"
    assert build_masks(_config(tiny_model, shards, out), Ranks(1, 2), predictor=SquarePredictor()) is None
    summary = build_masks(_config(tiny_model, shards, out), Ranks(0, 2), predictor=SquarePredictor())
    assert summary["written"] == 12
    keys = [r["key"] for r in read_manifest(out).to_pylist()]
    assert len(keys) == len(set(keys)) == 12
    build_masks(_config(tiny_model, shards, tmp_path / "single"), Ranks(), predictor=SquarePredictor())
    assert _files(out) == _files(tmp_path / "single")


def test_corrupt_and_hostile_samples_are_rejected(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(3)
    folder = tmp_path / "in"
    write_shard_set(samples, folder)
    tar = folder / "images-000000.tar"
    # Append a hostile member name and a corrupt JPEG to the tar, then re-index it.
    with tarfile.open(tar, "a") as archive:
        for name, data in (("../escape.jpg", jpeg_bytes(np.zeros((40, 40, 3), np.uint8))),
                           ("broken.jpg", b"\xff\xd8\xff\xe0 not a jpeg \xff\xd9")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    write_index(tar)
    # The manifest no longer describes the tar (a mixed set is refused as a whole): the tampered tar
    # is a plain WebDataset shard now, whose members are judged one by one.
    (folder / "manifest.parquet").unlink()
    out = tmp_path / "out"
    summary = build_masks(_config(tiny_model, folder, out), Ranks(), predictor=SquarePredictor())
    assert summary["written"] == 3 and summary["rejected"] == 2
    reasons = {r["reason"] for r in read_rejected(out).to_pylist()}
    assert reasons == {"unsafe_key", "truncated"}  # the image loader's reason, as shards build records it
    assert not (tmp_path / "escape.mask.png").exists() and not list(tmp_path.glob("escape*"))


def test_exif_rotated_image_gets_mask_in_displayed_orientation(tmp_path, tiny_model) -> None:
    data = orientation6_jpeg()  # stored 200 wide x 100 high, displayed 100 wide x 200 high
    from relicv2.shards import ShardSample

    write_shard_set([ShardSample("rotated", {"jpg": data}, None, {})], tmp_path / "in")
    build_masks(_config(tiny_model, tmp_path / "in", tmp_path / "out"), Ranks(), predictor=SquarePredictor())
    sample = next(iter(iter_samples(tmp_path / "out", report=ReadReport())))
    assert sample["jpg"] == data
    assert np.asarray(Image.open(io.BytesIO(sample["mask.png"]))).shape == (200, 100)
    assert (sample["meta"]["width"], sample["meta"]["height"]) == (100, 200)


def test_other_model_in_same_output_is_refused(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks(), predictor=SquarePredictor())
    other = tmp_path / "other.pt"
    other.write_bytes(tiny_model.read_bytes() + b"\0")
    with pytest.raises(MasksError, match="another model"):
        build_masks(_config(other, shards, tmp_path / "out"), Ranks(), predictor=SquarePredictor())


def test_masked_set_feeds_the_view_loader_with_masks_applied(tmp_path, scene_shards, tiny_model) -> None:
    from relicv2.pretrain.views.config import PARAM_NAMES, ViewConfig
    from relicv2.pretrain.views.loader import ViewLoader

    shards, _ = scene_shards
    build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks(), predictor=SquarePredictor())
    views = ViewConfig(large_size=32, small_size=16, mask_probability=1.0, debug_params=True, num_threads=1)
    loader = ViewLoader(tmp_path / "out", 4, views, backend="reference")
    batch = next(iter(loader))
    masked = batch["params"][:, :, PARAM_NAMES.index("masked")]
    assert masked[:, :4].sum() > 0  # large views were masked
    assert masked[:, 4:].sum() == 0  # small views never are
    assert index_path(tmp_path / "out" / "masked-000000.tar").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("flip", [False, True])
def test_gpu_masks_agree_with_cpu(tmp_path, scene_shards, tiny_model, flip) -> None:
    shards, _ = scene_shards
    build_masks(_config(tiny_model, shards, tmp_path / "cpu", flip=flip), Ranks())
    build_masks(_config(tiny_model, shards, tmp_path / "gpu", device="cuda", flip=flip), Ranks())
    cpu = {r["key"]: r["mask_coverage"] for r in read_manifest(tmp_path / "cpu").to_pylist()}
    gpu = {r["key"]: r["mask_coverage"] for r in read_manifest(tmp_path / "gpu").to_pylist()}
    assert cpu.keys() == gpu.keys()
    assert max(abs(cpu[k] - gpu[k]) for k in cpu) < 0.05  # bf16 autocast on GPU, fp32 on CPU


def _mirrored_pairs() -> list[ShardSample]:
    """Each generated scene and its mirror image, as lossless PNG (a mirrored JPEG decodes to other pixels)."""
    samples = []
    for i in range(3):
        rgb, _ = synthetic_scene(48, 64, seed=i)
        for key, pixels in ((f"scene{i}", rgb), (f"mirror{i}", rgb[:, ::-1])):
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, "PNG")
            samples.append(ShardSample(key, {"png": buffer.getvalue()}, i, {"width": 64, "height": 48}))
    return samples


def _masks(out: Path) -> dict[str, np.ndarray]:
    return {s["key"]: np.asarray(Image.open(io.BytesIO(s["mask.png"])), np.int16)
            for s in iter_samples(out, report=ReadReport())}


@pytest.mark.parametrize("flip", [False, True])
def test_flip_makes_the_mask_of_a_mirrored_image_the_mirrored_mask(tmp_path, flip) -> None:
    """The real network (random, so not mirror-symmetric) with `flip`: each mask is the mean of the image's
    prediction and its mirror's, so mirroring the image mirrors its mask (to the 8-bit rounding of the
    resizes); without `flip` they differ."""
    import torch

    from relicv2.saliency.network.model import SaliencyNet
    from relicv2.saliency.network.model_file import save_model

    torch.manual_seed(0)
    net = SaliencyNet(18).eval()
    with torch.no_grad():  # a random network's map is nearly flat: sharpen it so that its asymmetry shows in 8 bits
        net.fuse[-1].weight.mul_(200.0)
    model = save_model(tmp_path / "sharp.pt", net, input_size=32, preset="tiny", backbone="random initialisation",
                       config={}, report={})
    write_shard_set(_mirrored_pairs(), tmp_path / "in", max_count=6)
    summary = build_masks(_config(model, tmp_path / "in", tmp_path / "out", flip=flip), Ranks())
    assert summary["written"] == 6
    masks = _masks(tmp_path / "out")
    worst = max(np.abs(masks[f"scene{i}"] - masks[f"mirror{i}"][:, ::-1]).max() for i in range(3))
    if flip:
        assert worst <= 2, worst
    else:
        assert worst > 10, worst


def test_a_rerun_with_another_flip_setting_is_refused_and_the_old_plan_still_resumes(tmp_path, scene_shards,
                                                                                      tiny_model) -> None:
    """Masks made with and without `flip` are different sets: the same --out refuses the other setting. A job
    without `flip` keeps the plan it had before the setting existed, so its interrupted runs still resume."""
    shards, _ = scene_shards
    out = tmp_path / "out"
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert set(json.loads((out / STATE_DIR / PLAN_NAME).read_text())) == {"model_sha256", "input_shards",
                                                                                 "prefix"}
    with pytest.raises(MasksError, match="flip or crf setting"):
        build_masks(_config(tiny_model, shards, out, flip=True), Ranks(), predictor=SquarePredictor())
    flipped = tmp_path / "flipped"
    build_masks(_config(tiny_model, shards, flipped, flip=True), Ranks(), predictor=SquarePredictor())
    with pytest.raises(MasksError, match="flip or crf setting"):
        build_masks(_config(tiny_model, shards, flipped), Ranks(), predictor=SquarePredictor())

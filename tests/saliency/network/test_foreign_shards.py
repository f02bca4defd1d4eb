"""Plain WebDataset shards (webdataset.ShardWriter, `train-0000.tar`, no manifest, no index, jpg/jpeg/png/webp
images, `cls` on some samples only) as the input of `saliency train` and `saliency build-masks`."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.main import cli
from relicv2.saliency.network.build_masks import BuildMasksConfig, MasksError, build_masks
from relicv2.saliency.network.data import write_sample_set
from relicv2.shards import ReadReport, iter_samples, read_manifest
from relicv2.shards.build import Ranks
from relicv2.shards.sample import MASK_MEMBER
from tests.saliency.network.conftest import SquarePredictor
from tests.scenes import synthetic_scene

FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
SAMPLES = 10  # 4 + 4 + 2 over train-0000 .. train-0002


def _encoded(rgb: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
    return buffer.getvalue()


def _snapshot(folder: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The folder's mtime (any file created, renamed or removed in it changes it) and its files."""
    return folder.stat().st_mtime_ns, {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture
def foreign(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """Ten 48 x 64 scenes written by webdataset.ShardWriter as train-%04d.tar (4 per tar), the image
    member cycling jpg, jpeg, png, webp, a `cls` on every other sample; with what was written."""
    import webdataset as wds

    folder = tmp_path / "foreign"
    folder.mkdir()
    written = {}
    with wds.ShardWriter(str(folder / "train-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(SAMPLES):
            ext = list(FORMATS)[i % 4]
            rgb, _ = synthetic_scene(48, 64, seed=i)
            sample = {"__key__": f"img{i:03d}", ext: _encoded(rgb, FORMATS[ext])}
            if i % 2 == 0:
                sample["cls"] = str(i % 3).encode()
            elif i == SAMPLES - 1:
                sample["cls"] = b"tabby cat\n"  # a class name, as some tools write: masks need no label
            sink.write(sample)
            written[f"img{i:03d}"] = {"ext": ext, "image": sample[ext], "label": i % 3 if i % 2 == 0 else None}
    assert sorted(p.name for p in folder.iterdir()) == ["train-0000.tar", "train-0001.tar", "train-0002.tar"]
    return folder, written


def _config(shards, out: Path, cache: Path, model: Path) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=2, batch_size=3, progress=False,
                            index_cache=cache)


def _tars(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("masked-*"))}


def test_build_masks_on_a_plain_webdataset_set(tmp_path, foreign, tiny_model) -> None:
    folder, written = foreign
    cache, out = tmp_path / "cache", tmp_path / "out"
    before = _snapshot(folder)
    summary = build_masks(_config(folder, out, cache, tiny_model), Ranks(), predictor=SquarePredictor())
    assert summary["written"] == SAMPLES and summary["rejected"] == 0
    assert _snapshot(folder) == before  # nothing written beside the input tars
    assert len(list(cache.glob("train-000[0-2]-*.idx"))) == 3  # the derived indexes went to --index-cache

    masked = {s["key"]: s for s in iter_samples(out, report=ReadReport())}
    assert masked.keys() == written.keys()
    named = f"img{SAMPLES - 1:03d}"
    assert masked[named]["label"] is None and masked[named]["meta"]["source_cls"] == "tabby cat"
    for key, source in written.items():
        sample = masked[key]
        member = "jpg" if source["ext"] == "jpeg" else source["ext"]  # png/webp never announced as jpg
        assert sample["image_ext"] == member and sample[member] == source["image"]  # bytes unchanged
        assert sample["label"] == source["label"]
        mask = np.asarray(Image.open(io.BytesIO(sample[MASK_MEMBER])))
        assert mask.shape == (48, 64) and sample["meta"]["mask_coverage"] == pytest.approx(0.25, abs=0.03)
    assert sorted(p.name for p in out.glob("masked-*.tar")) == [f"masked-00000{n}.tar" for n in range(3)]
    assert [r["label"] for r in read_manifest(out).sort_by("key").to_pylist()] == [
        written[k]["label"] for k in sorted(written)]

    result = CliRunner().invoke(cli, ["shards", "verify", str(out), "--workers", "1", "--no-progress"])
    assert result.exit_code == 0 and f"3 shards, {SAMPLES} samples" in result.output, result.output


@pytest.mark.parametrize("backend", ["reference", "dali"])
def test_masked_foreign_set_feeds_the_view_loader(tmp_path, foreign, tiny_model, backend) -> None:
    from relicv2.pretrain.views.config import PARAM_NAMES, ViewConfig
    from relicv2.pretrain.views.loader import ViewLoader, dali_available

    if backend == "dali" and not dali_available():
        pytest.skip("NVIDIA DALI is not installed")
    folder, _ = foreign
    out = tmp_path / "out"
    build_masks(_config(folder, out, tmp_path / "cache", tiny_model), Ranks(), predictor=SquarePredictor())
    views = ViewConfig(large_size=32, small_size=16, mask_probability=1.0, debug_params=True, num_threads=1)
    loader = ViewLoader(out, 4, views, backend=backend)
    batches = [batch for _, batch in zip(range(3), loader, strict=False)]
    assert len(batches) == 2 and not loader.skipped  # 10 samples: two full batches, none left out
    keys = {k for b in batches for k in b["keys"]}
    assert len(keys) == 8 and all(b["views"][0].shape[-2:] == (32, 32) for b in batches)
    masked = np.concatenate([b["params"][:, :4, PARAM_NAMES.index("masked")].numpy() for b in batches])
    assert masked.all()  # every large view carried its mask (coverage 0.25, probability 1)


def test_brace_pattern_and_read_only_input_give_the_same_set(tmp_path, foreign, tiny_model) -> None:
    folder, _ = foreign
    build_masks(_config(folder, tmp_path / "from-folder", tmp_path / "c1", tiny_model), Ranks(),
                predictor=SquarePredictor())
    for path in (*folder.iterdir(), folder):
        path.chmod(stat.S_IRUSR | stat.S_IXUSR if path.is_dir() else stat.S_IRUSR)
    try:
        before = _snapshot(folder)
        pattern = str(folder / "train-{0000..0002}.tar")
        result = CliRunner().invoke(cli, ["saliency", "build-masks", "--model", str(tiny_model), "--shards", pattern,
                                          "--out", str(tmp_path / "from-pattern"), "--batch", "3", "--no-progress",
                                          "--index-cache", str(tmp_path / "c2")])
        assert result.exit_code == 0, result.output
        assert f"{SAMPLES} masked, 0 rejected" in result.output
        assert _snapshot(folder) == before
    finally:
        for path in (folder, *folder.iterdir()):
            path.chmod(stat.S_IRWXU)
    assert len(list((tmp_path / "c2").glob("*.idx"))) == 3
    # The CLI ran the real network, the folder run the stand-in: compare what both take from the input.
    ours = {s["key"]: (s["image"], s["label"]) for s in iter_samples(tmp_path / "from-folder", report=ReadReport())}
    theirs = {s["key"]: (s["image"], s["label"]) for s in iter_samples(tmp_path / "from-pattern", report=ReadReport())}
    assert ours == theirs and len(ours) == SAMPLES


def test_unusable_cache_and_inputs_are_one_clear_error(tmp_path, foreign, tiny_model) -> None:
    folder, _ = foreign
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="choose a writable index cache"):
        build_masks(_config(folder, tmp_path / "out", blocker / "sub", tiny_model), Ranks(),
                    predictor=SquarePredictor())
    with pytest.raises(MasksError, match="holds input shards"):
        build_masks(_config(folder, folder, tmp_path / "cache", tiny_model), Ranks(), predictor=SquarePredictor())
    twice = str(folder / "train-{0000,0001,0000}.tar")
    with pytest.raises(MasksError, match="more than once"):
        build_masks(_config(twice, tmp_path / "out", tmp_path / "cache", tiny_model), Ranks(),
                    predictor=SquarePredictor())


class _Killed(Exception):
    pass


class _DiesInSecondShard(SquarePredictor):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, squares):
        self.calls += 1
        if self.calls == 3:  # train-0000 takes two batches (3 + 1); die inside train-0001
            raise _Killed
        return super().__call__(squares)


def test_kill_and_resume_on_a_foreign_set_is_byte_identical(tmp_path, foreign, tiny_model) -> None:
    folder, _ = foreign
    cache = tmp_path / "cache"
    build_masks(_config(folder, tmp_path / "whole", cache, tiny_model), Ranks(), predictor=SquarePredictor())
    resumed = tmp_path / "resumed"
    with pytest.raises(_Killed):
        build_masks(_config(folder, resumed, cache, tiny_model), Ranks(), predictor=_DiesInSecondShard())
    assert (resumed / "masked-000000.tar").is_file() and not (resumed / "masked-000001.tar").exists()
    kept = (resumed / "masked-000000.tar").stat().st_mtime_ns
    build_masks(_config(folder, resumed, cache, tiny_model), Ranks(), predictor=SquarePredictor())
    assert (resumed / "masked-000000.tar").stat().st_mtime_ns == kept
    files = ("manifest.parquet", "rejected.parquet")
    assert _tars(resumed) == _tars(tmp_path / "whole")
    assert all((resumed / f).read_bytes() == (tmp_path / "whole" / f).read_bytes() for f in files)
    # Two ranks split the foreign tars without overlap or loss, each indexing only the tars it reads.
    split, own_cache = tmp_path / "split", tmp_path / "split-cache"
    assert build_masks(_config(folder, split, own_cache, tiny_model), Ranks(1, 2), predictor=SquarePredictor()) is None
    assert sorted(p.name for p in split.glob("masked-*.tar")) == ["masked-000001.tar", "masked-000002.tar"]
    assert sorted(p.name.rsplit("-", 1)[0] for p in own_cache.iterdir()) == ["train-0001", "train-0002"]
    build_masks(_config(folder, split, own_cache, tiny_model), Ranks(0, 2), predictor=SquarePredictor())
    assert _tars(split) == _tars(tmp_path / "whole")
    assert len(list(own_cache.iterdir())) == 3  # train-0000 by rank 0; none derived twice


def test_train_samples_a_plain_webdataset_set_from_a_folder_and_a_pattern(tmp_path, foreign) -> None:
    folder, written = foreign
    cache = tmp_path / "cache"
    before = _snapshot(folder)
    from_folder, skipped = write_sample_set(folder, tmp_path / "a", SAMPLES, seed=0, index_cache=cache)
    assert not skipped
    sampled = {s["key"]: s for s in iter_samples(from_folder, report=ReadReport())}
    assert sampled.keys() == written.keys()  # every image member name is seen, not only jpg
    for key, sample in sampled.items():
        assert sample["image"] == written[key]["image"] and sample["label"] == written[key]["label"]
    assert {s["image_ext"] for s in sampled.values()} == {"jpg", "png", "webp"}

    out = tmp_path / "train"
    pattern = str(folder / "train-{0000..0002}.tar")
    result = CliRunner().invoke(cli, [
        "saliency", "train", "--shards", pattern, "--out", str(out), "--preset", "tiny", "--backbone", "random",
        "--index-cache", str(cache), "--no-progress", "--set", "methods=mc", "--set", "num_images=6",
        "--set", "epochs=1", "--set", "fuse_epochs=1"])
    assert result.exit_code == 0, result.output
    assert "6 images (0 left out)" in result.output
    assert (out / "model.pt").is_file()
    exts = {s["image_ext"] for s in iter_samples(out / "sample", report=ReadReport())}
    assert exts <= {"jpg", "png", "webp"} and len(exts) >= 2
    assert _snapshot(folder) == before and len(list(cache.glob("*.idx"))) == 3


def test_verify_flags_an_image_stored_under_another_formats_name(tmp_path) -> None:
    from relicv2.shards import ShardSample, verify_shard_set, write_shard_set

    rgb, _ = synthetic_scene(48, 64, seed=1)
    write_shard_set([ShardSample("honest", {"png": _encoded(rgb, "PNG")}, None, {"width": 64, "height": 48}),
                     ShardSample("liar", {"png": _encoded(rgb, "JPEG")}, None, {"width": 64, "height": 48})],
                    tmp_path / "set")
    report = verify_shard_set(tmp_path / "set", workers=1)
    assert len(report.problems) == 1 and "'liar'" in report.problems[0] and ".png is JPEG" in report.problems[0]

"""`saliency build-masks` on the shard-job engine: a rerun redoes the shards whose input or output no
longer matches its done record, and the job's outputs are checked before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relicv2.saliency.network.build_masks import BuildMasksConfig, MasksError, build_masks
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import ModelFileError, save_model
from relicv2.shards import read_manifest, write_shard_set
from relicv2.shards.build import Ranks
from relicv2.shards.index import index_path
from relicv2.shards.verify import verify_shard_set
from tests.saliency.network.conftest import SquarePredictor, scene_samples

REPO = Path(__file__).resolve().parents[3]


def _config(model: Path, shards: Path, out: Path, **kw) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=0, batch_size=3, progress=False, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    """The masked set's files (config.yaml names the job's own folder and settings: left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "config.yaml"}


def _verified(out: Path) -> None:
    report = verify_shard_set(out, decode_images=False)
    assert report.ok, report.problems


def test_an_input_set_rebuilt_under_the_same_names_is_masked_again(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(12)
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards, max_count=4)
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    # An interrupted run: the last shard was not finished.
    (out / "masked-000002.tar").unlink()
    index_path(out / "masked-000002.tar").unlink()
    for name in ("manifest.parquet", "rejected.parquet", "info.json"):
        (out / name).unlink()
    records = sorted((out / ".build-masks").glob("000002*"))
    assert records
    for record in records:
        record.unlink()
    # The same shard names, the same keys, shuffled into other shards (another seed).
    write_shard_set(samples[::-1], shards, max_count=4)
    summary = build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (summary["written"], summary["rejected"], summary["shards_built"]) == (12, 0, 3)
    keys = read_manifest(out).column("key").to_pylist()
    assert sorted(keys) == sorted(s.key for s in samples)
    _verified(out)
    whole = tmp_path / "whole"
    build_masks(_config(tiny_model, shards, whole), Ranks(), predictor=SquarePredictor())
    assert _files(out) == _files(whole)


def test_a_damaged_masked_shard_is_masked_again(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "out"
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    reference = _files(out)
    tar = out / "masked-000001.tar"
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF
    tar.write_bytes(bytes(data))
    index_path(tar).write_bytes(b"")
    summary = build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (summary["shards_kept"], summary["shards_built"]) == (2, 1)
    assert _files(out) == reference
    _verified(out)


def test_a_corrupt_settings_record_is_named(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "out"
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    plans = [p for p in (out / ".build-masks").iterdir() if not p.name[0].isdigit()]
    assert len(plans) == 1
    plans[0].write_text("{not json")
    with pytest.raises(MasksError) as refused:
        build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert str(plans[0]) in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("size", [0, -32])
def test_a_model_without_a_usable_input_size_is_refused_and_leaves_no_out(tmp_path, scene_shards, size) -> None:
    shards, _ = scene_shards
    model = save_model(tmp_path / "m" / "model.pt", SaliencyNet(18).eval(), input_size=size, preset="tiny",
                       backbone="random initialisation", config={}, report={})
    with pytest.raises(ModelFileError, match=rf"model\.pt records an impossible input size .*got {size}\)"):
        build_masks(_config(model, shards, tmp_path / "a" / "out"), Ranks())
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("device", ["bogus", "cuda:0" if not torch.cuda.is_available() else "cuda:999"])
def test_an_unusable_device_is_one_line_and_leaves_no_out(tmp_path, scene_shards, tiny_model, device) -> None:
    shards, _ = scene_shards
    with pytest.raises(MasksError, match=f"--device {device}") as refused:
        build_masks(_config(tiny_model, shards, tmp_path / "out", device=device), Ranks())
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_out_below_a_file_is_one_line(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(MasksError, match="a-file") as refused:
        build_masks(_config(tiny_model, shards, tmp_path / "a-file" / "out"), Ranks(), predictor=SquarePredictor())
    assert "\n" not in str(refused.value)


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # room for the ring of batches, not for the tar
from relicv2.cli.main import main
sys.argv = ["relicv2", *sys.argv[1:]]
main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE stands in for a full disk")
def test_a_full_disk_is_one_line_and_leaves_no_partial_tar(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(12, height=192, width=256)
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards)
    assert (shards / "images-000000.tar").stat().st_size > 1 << 17
    command = [sys.executable, "-c", _FULL_DISK, "saliency", "build-masks", "--model", str(tiny_model),
               "--shards", str(shards), "--out", str(out), "--workers", "0", "--batch", "2", "--no-progress"]
    job = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 1, job.stderr
    assert "Traceback" not in job.stderr
    error = [line for line in job.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "masked-000000.tar" in error[0], job.stderr
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []  # no output under a final name


def test_rank_0_refuses_to_merge_the_stale_records_of_another_rank_naming_them(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(12)
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards, max_count=4)
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    write_shard_set(samples[::-1], shards, max_count=4)  # rebuilt under the same names
    # Rank 0 of 2 redoes its own shards; rank 1 has not run yet: its records are from the old input.
    with pytest.raises(MasksError, match=r"2 shard\(s\) .* not finished from the current inputs \(masked-000001\.tar, masked-000002\.tar\)"):
        build_masks(_config(tiny_model, shards, out, merge_timeout_s=0), Ranks(0, 2), predictor=SquarePredictor())
    build_masks(_config(tiny_model, shards, out), Ranks(1, 2), predictor=SquarePredictor())
    summary = build_masks(_config(tiny_model, shards, out), Ranks(0, 2), predictor=SquarePredictor())
    assert (summary["written"], summary["shards_kept"]) == (12, 3)
    _verified(out)

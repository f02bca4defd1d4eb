"""One reader, one policy for bad members: every job that reads shard samples survives a hostile
member (a json nested 100,000 deep, a duplicate key, an unused member) and names it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from relicv2 import shards
from relicv2.cli.saliency import saliency_group
from tests.scenes import synthetic_scene
from tests.tars import write_tar

DEEP = b"[" * 100_000  # a json member nested far past any recursion limit


def jpeg(seed: int) -> bytes:
    rgb, _ = synthetic_scene(48, 64, seed=seed)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def hostile_set(folder: Path) -> Path:
    """A plain labelled set of 4 samples, the third of which has a json member nested 100,000 deep."""
    members = []
    for i in range(4):
        members += [(f"s{i}.cls", str(i % 2).encode()), (f"s{i}.jpg", jpeg(i))]
        members.append((f"s{i}.json", DEEP if i == 2 else b'{"source": "x"}'))
    write_tar(folder / "train-0000.tar", members)
    return folder


def test_the_reader_rejects_deep_oversized_and_duplicate_members_with_reasons(tmp_path):
    members = [("a.jpg", jpeg(0)), ("b.jpg", jpeg(1)), ("b.json", DEEP), ("c.jpg", jpeg(2)),
               ("c.json", b'{"x": ' + b"1" * 250_000 + b"}"), ("a.jpg", jpeg(3)), ("d.jpg", jpeg(4)),
               ("d.txt", b"notes"), ("e.jpg", jpeg(5)), ("e.json", b"{not json")]
    tar = write_tar(tmp_path / "t-0000.tar", members)
    report = shards.ReadReport()
    limits = shards.ImageLimits(max_json_bytes=200_000)
    keys = [s["key"] for s in shards.iter_samples(tar, report=report, limits=limits)]
    assert keys == ["a", "d"]
    reasons = {name: why for _, name, why in report.rejected}
    assert set(reasons) == {"b", "c", "a", "e"}
    assert "deeper" in reasons["b"] and "over the limit" in reasons["c"] and "duplicate" in reasons["a"]
    assert "not valid JSON" in reasons["e"]
    assert report.reasons == {"json_too_deep": 1, "json_too_large": 1, "duplicate_key": 1, "bad_json": 1}
    assert report.unused == {"txt": 1} and "txt" in report.summary()


def test_the_read_report_cannot_be_left_out(tmp_path):
    tar = write_tar(tmp_path / "t-0000.tar", [("a.jpg", jpeg(0))])
    with pytest.raises(TypeError):
        list(shards.iter_samples(tar))  # no report: a loss could go unseen


def test_shards_verify_names_a_deep_json_member(tmp_path):
    folder = hostile_set(tmp_path / "set")
    report = shards.verify_shard_set(folder, index_cache=tmp_path / "cache")
    assert report.samples == 3 and not report.ok
    assert any("s2" in p and "deeper" in p for p in report.problems), report.problems


def test_saliency_handcrafted_rejects_a_deep_json_member(tmp_path):
    folder = hostile_set(tmp_path / "set")
    out = tmp_path / "maps"
    result = CliRunner().invoke(saliency_group, ["handcrafted", "--no-progress", "--method", "mc",
                                                 "--input", str(folder), "--output", str(out)])
    assert isinstance(result.exception, SystemExit), result.exception  # no RecursionError traceback
    assert result.exit_code == 1, result.output  # a sample lost: never a silent success
    assert "s2" in result.output and "deeper" in result.output
    assert sorted(p.stem for p in (out / "mc").glob("*.png")) == ["s0", "s1", "s3"]


def test_eval_knn_features_reject_a_deep_json_member(tmp_path):
    from relicv2.pretrain.knn.extract import extract_features
    from relicv2.pretrain.knn.outcome import LostSamplesError

    folder = hostile_set(tmp_path / "set")
    encoder = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(LostSamplesError, match="deeper"):
        extract_features(encoder, shards.resolve_shard_set(folder), crop_size=16)
    lost = []
    features, labels = extract_features(encoder, shards.resolve_shard_set(folder), crop_size=16, allow_lost=True,
                                        lost=lost)
    assert len(labels) == 3 and "deeper" in lost[0].detail


def test_the_report_rejects_a_deep_json_member(tmp_path):
    from relicv2.evaluation.report.inputs import read_saliency_samples

    folder = hostile_set(tmp_path / "set")
    samples, problems = read_saliency_samples(folder, None, count=4)
    assert [s.key for s in samples] == ["s0", "s1", "s3"]
    assert any("s2" in p and "deeper" in p for p in problems), problems


def test_an_unsafe_member_is_a_rejection_with_its_reason(tmp_path):
    tar = write_tar(tmp_path / "t-0000.tar", [("ok.jpg", jpeg(0)), ("../up.jpg", jpeg(1))])
    report = shards.ReadReport()
    assert [s["key"] for s in shards.iter_samples(tar, report=report)] == ["ok"]
    assert report.reasons == {"unsafe_key": 1} and report.rejected[0][1] == "../up.jpg"


def test_saliency_handcrafted_says_which_members_it_does_not_read(tmp_path):
    folder = tmp_path / "set"
    write_tar(folder / "train-0000.tar", [("s0.jpg", jpeg(0)), ("s0.txt", b"a caption")])
    result = CliRunner().invoke(saliency_group, ["handcrafted", "--no-progress", "--method", "mc",
                                                 "--input", str(folder), "--output", str(tmp_path / "maps")])
    assert result.exit_code == 0, result.output
    assert "members no job reads, left as they are: {'txt': 1}" in result.output


def test_verify_matches_samples_after_a_rejected_one_to_their_own_manifest_rows(tmp_path):
    folder = tmp_path / "set"
    shards.write_shard_set([shards.ShardSample(k, {"jpg": jpeg(i)}, i, {"n": i}) for i, k in enumerate("abc")], folder)
    tar = folder / "images-000000.tar"
    with tarfile.open(tar) as archive:
        members = [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]
    write_tar(tar, [(name, data) for name, data in members if name != "a.jpg"])  # `a` loses its image
    problems = shards.verify_shard_set(folder, index_cache=tmp_path / "cache").problems
    assert any("'a'" in p and "no_image" in p for p in problems), problems
    assert not any("'b'" in p or "'c'" in p for p in problems), problems  # b and c still match rows 1 and 2

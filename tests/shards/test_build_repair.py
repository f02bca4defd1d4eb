"""Rerunning `relicv2 shards build` repairs a damaged set; refused builds and empty sets say what to do."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from relicv2.cli.shards import shards_group
from relicv2.shards.build import build_shards
from relicv2.shards.merge import work_dir
from relicv2.shards.sources import InputError
from relicv2.shards.verify import verify_shard_set
from tests.shards.test_build import config, encoded, flat_folder, image, set_bytes


def cli_build(monkeypatch, src: Path, out: Path, *options: str):
    """Run `relicv2 shards build` as a user would type it (the command is recorded from sys.argv)."""
    args = ["build", str(src), str(out), "--workers", "1", "--min-side", "16", "--no-progress", *options]
    monkeypatch.setattr(sys, "argv", ["relicv2", "shards", *args])
    return CliRunner().invoke(shards_group, args)


def markers(out: Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["shard"]: json.loads(p.read_text()) for p in work_dir(out).glob("*.done.json")}


def test_rerunning_the_build_rebuilds_a_truncated_shard(tmp_path, monkeypatch):
    src, out = flat_folder(tmp_path / "in", 15, side=64), tmp_path / "out"
    result = cli_build(monkeypatch, src, out, "--max-count", "4")
    assert result.exit_code == 0, result.output
    reference = set_bytes(out)
    tar = out / "images-000001.tar"
    os.truncate(tar, tar.stat().st_size // 2)
    result = CliRunner().invoke(shards_group, ["verify", str(out), "--workers", "1", "--no-progress"])
    command = f"relicv2 shards build {src} {out} --workers 1 --min-side 16 --no-progress --max-count 4"
    assert result.exit_code == 1 and "images-000001.tar" in result.output
    assert ("rerun the build that made this set, which re-hashes its shards and rebuilds damaged ones: "
            f"{command} --rehash-shards") in result.output
    result = cli_build(monkeypatch, src, out, "--max-count", "4")
    assert result.exit_code == 0, result.output
    assert "rebuilding images-000001.tar, finished by an earlier run: its tar has" in result.output
    assert "1 shard(s) built (1 of them finished by an earlier run, changed since: rebuilt), 3 kept" in result.output
    assert set_bytes(out) == reference  # tar, index, manifest and info exactly as first built
    result = CliRunner().invoke(shards_group, ["verify", str(out), "--workers", "1", "--no-progress"])
    assert result.exit_code == 0 and "OK, 4 shards, 15 samples verified" in result.output


def test_changed_bytes_or_index_are_rebuilt_and_a_touched_copy_is_kept(tmp_path):
    src, out = flat_folder(tmp_path / "in", 12, side=64), tmp_path / "out"
    build_shards(config(src, out, max_count=4))
    reference = set_bytes(out)
    tar = out / "images-000000.tar"
    data = bytearray(tar.read_bytes())
    data[5000] ^= 0xFF  # same size, other bytes
    tar.write_bytes(bytes(data))
    (out / "images-000002.idx").write_text("1 tampered\n")
    report = build_shards(config(src, out, max_count=4))
    assert report.repaired == ("images-000000.tar", "images-000002.tar")
    assert (report.shards_built, report.shards_kept) == (2, 2)
    assert set_bytes(out) == reference and verify_shard_set(out).ok
    # Same bytes, new times (a copy): kept, and the new times recorded so the next rerun hashes nothing.
    for t in out.glob("*.tar"):
        os.utime(t, ns=(t.stat().st_atime_ns, t.stat().st_mtime_ns + 10**9))
    report = build_shards(config(src, out, max_count=4))
    assert (report.shards_built, report.shards_kept, report.repaired) == (0, 4, ())
    assert {n: m["tar_mtime_ns"] for n, m in markers(out).items()} == {
        t.name: t.stat().st_mtime_ns for t in out.glob("*.tar")}


def test_done_records_from_before_files_were_recorded_are_kept(tmp_path):
    src, out = flat_folder(tmp_path / "in", 8, side=64), tmp_path / "out"
    build_shards(config(src, out, max_count=4))
    for path in work_dir(out).glob("*.done.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in record.items() if not k.startswith(("tar_", "index_"))}))
    report = build_shards(config(src, out, max_count=4))
    assert (report.shards_built, report.shards_kept) == (0, 3)  # presence is all an old record can vouch for
    (out / "images-000001.tar").unlink()
    report = build_shards(config(src, out, max_count=4))
    assert report.repaired == ("images-000001.tar",) and verify_shard_set(out).ok


def test_verify_refuses_an_empty_set(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "notes.txt").write_text("no images here\n")
    result = CliRunner().invoke(shards_group, ["build", str(src), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1
    result = CliRunner().invoke(shards_group, ["verify", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1 and "OK" not in result.output
    assert "manifest.parquet: lists no samples, the set is empty; every input was rejected" in result.output
    assert "(0 shards, 0 samples)" in result.output and "rerun the build" not in result.output


@pytest.mark.parametrize("made", [False, True])
def test_a_refused_build_leaves_no_empty_output_folder(tmp_path, made):
    empty_input = tmp_path / "empty"
    empty_input.mkdir()
    out = tmp_path / "a" / "b" / "out"
    if made:  # a folder the user made is theirs: kept
        out.mkdir(parents=True)
    for src in (tmp_path / "nosuch", empty_input):
        with pytest.raises(InputError, match="does not exist|no files found"):
            build_shards(config(src, out))
        assert out.is_dir() == made and (tmp_path / "a").exists() == made
    if made:
        assert list(out.iterdir()) == []


def test_a_rerun_with_other_settings_or_inputs_names_what_differs(tmp_path):
    src, out = flat_folder(tmp_path / "in", 6, side=64), tmp_path / "out"
    build_shards(config(src, out, max_count=4))
    with pytest.raises(InputError, match=r"other inputs or settings \(max_count: 4 there, 3 now; seed: 0 there, 2 "
                                         r"now\); choose a new --out folder or pass --overwrite"):
        build_shards(config(src, out, max_count=3, seed=2))
    (src / "more.jpg").write_bytes(encoded(image(99, size=(64, 64)), "JPEG"))
    with pytest.raises(InputError, match=r"\(input files: 7 there, 8 now\)"):
        build_shards(config(src, out, max_count=4))


def test_the_way_to_list_rejected_files_works_without_pandas(tmp_path, monkeypatch):
    src, out = flat_folder(tmp_path / "in", 3, side=64), tmp_path / "out"
    result = cli_build(monkeypatch, src, out)
    assert result.exit_code == 0, result.output
    line = next(n for n in result.output.splitlines() if "list them with: " in n)
    argv = shlex.split(line.split("list them with: ", 1)[1])
    assert argv[:2] == ["python", "-c"]
    no_pandas = tmp_path / "no_pandas"
    (no_pandas / "pandas").mkdir(parents=True)
    (no_pandas / "pandas" / "__init__.py").write_text("raise ImportError('pandas is not installed')\n")
    listed = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(no_pandas)}).stdout
    assert listed.splitlines() == [
        "{'source': 'broken.jpg', 'reason': 'not_an_image', 'detail': 'content is not an image format PIL can identify'}"]

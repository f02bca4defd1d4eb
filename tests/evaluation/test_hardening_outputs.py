"""Eval, export and subset outputs a job cannot write: one line naming the path, before the work, no
partial file (never a traceback, never a failure found after the whole evaluation)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from relicv2.cli.eval import eval_group
from relicv2.cli.main import cli
from tests.evaluation.test_export import _checkpoint
from tests.paths import REPO
from tests.unwritable import immutable, small_disk

FAST = ["--preset", "fast", "--set", "epochs=2", "--set", "crop_size=32", "--set", "resize_size=32", "--device", "cpu"]


def _linear(train, val, *extra: str):
    return CliRunner().invoke(eval_group, ["linear", "--random-init", "18", "--train", str(train), "--val", str(val),
                                           *FAST, *extra])


def _one_line(result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # a click error, not a traceback
    assert all(word in result.output for word in words), result.output


def test_linear_refuses_an_output_folder_that_is_a_file(shape_shards, tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file")
    result = _linear(*shape_shards, "--output", str(blocker))
    _one_line(result, "--output", str(blocker), "is a file")
    assert blocker.read_text() == "a file"


def test_linear_refuses_an_unwritable_json_before_the_work(shape_shards, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    with immutable(folder):
        result = _linear(*shape_shards, "--json", str(folder / "linear.json"))
    _one_line(result, "--json", "not writable")
    assert "top-1" not in result.output  # refused at start, not after the evaluation
    assert list(folder.iterdir()) == []
    as_folder = _linear(*shape_shards, "--json", str(folder))
    _one_line(as_folder, "--json", "is a folder")
    assert "top-1" not in as_folder.output


def test_subset_refuses_a_folder_or_an_unwritable_place_as_out(shape_shards, tmp_path):
    train, _ = shape_shards
    folder = tmp_path / "splits"
    folder.mkdir()
    as_folder = CliRunner().invoke(cli, ["shards", "subset", str(train), "--fraction", "0.5", "--out", str(folder)])
    _one_line(as_folder, "--out", "is a folder")
    with immutable(folder):
        locked = CliRunner().invoke(cli, ["shards", "subset", str(train), "--fraction", "0.5",
                                          "--out", str(folder / "half.txt")])
    _one_line(locked, "--out", "not writable")
    assert list(folder.iterdir()) == []


def test_export_to_a_full_disk_is_one_line_and_leaves_no_file(tmp_path):
    _checkpoint(tmp_path / "run")
    out = tmp_path / "exported" / "r18.pt"
    out.parent.mkdir()
    job = subprocess.run([sys.executable, "-m", "relicv2", "export", "--checkpoint", str(tmp_path / "run"),
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=small_disk(1 << 20))
    assert job.returncode == 1, job.stderr
    assert "Traceback" not in job.stderr and str(out) in job.stderr, job.stderr
    assert list(out.parent.iterdir()) == []  # neither the file nor a temporary of it


def test_labels_pointing_at_a_folder_says_it_is_a_folder(shape_shards, tmp_path):
    train, val = shape_shards
    result = CliRunner().invoke(eval_group, ["finetune", "--random-init", "18", "--train", str(train), "--val",
                                             str(val), "--labels", str(tmp_path), "--device", "cpu"])
    _one_line(result, str(tmp_path), "is a folder")
    assert "does not exist" not in result.output


def test_a_sidecar_that_cannot_be_written_leaves_no_new_weights(tmp_path):
    from relicv2.models.encoder_file import save_encoder_file
    from relicv2.pretrain.checkpoint import random_encoder

    out = tmp_path / "r18.pt"
    with pytest.raises(TypeError):  # the sidecar's JSON fails after the weights were written to disk
        save_encoder_file(random_encoder(18), out, depth=18, width=1, metadata={"not json": object()})
    assert list(tmp_path.iterdir()) == []  # no weights without their sidecar, no temporary

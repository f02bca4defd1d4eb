"""The `relicv2` entry points: console script, `python -m relicv2`, the default `pretrain` sub-command."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from relicv2.cli.main import cli


def test_python_dash_m_cli_lists_every_stage():
    result = subprocess.run([sys.executable, "-m", "relicv2", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for group in ("shards", "saliency", "pretrain", "eval", "demo-data"):
        assert group in result.stdout


def test_pretrain_without_subcommand_dispatches_to_run():
    runner = CliRunner()
    explicit = runner.invoke(cli, ["pretrain", "run", "--help"])
    implicit = runner.invoke(cli, ["pretrain", "--help"])
    assert explicit.exit_code == 0 and implicit.exit_code == 0
    assert "preview-views" in implicit.output
    # An option meant for `run` reaches `run` when the sub-command is left out.
    assert runner.invoke(cli, ["pretrain", "--no-such-option"]).output == \
        runner.invoke(cli, ["pretrain", "run", "--no-such-option"]).output


def test_demo_data_writes_a_labelled_tree(tmp_path):
    result = CliRunner().invoke(cli, ["demo-data", str(tmp_path), "--train-per-class", "2",
                                      "--val-per-class", "1", "--size", "48"])
    assert result.exit_code == 0, result.output
    classes = sorted(p.name for p in (tmp_path / "val").iterdir())
    assert len(classes) == 8
    assert all(len(list((tmp_path / "val" / c).glob("*.jpg"))) == 1 for c in classes)
    # The awkward inputs that `shards build` must convert or reject are there too.
    assert (tmp_path / "train" / "astronaut" / "empty.jpg").stat().st_size == 0


def test_ctrl_c_outside_training_ends_with_one_line_and_exit_130(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("relicv2.cli.shards.build_shards", interrupted)
    (tmp_path / "images").mkdir()
    result = CliRunner().invoke(cli, ["shards", "build", str(tmp_path / "images"), str(tmp_path / "out")])
    assert result.exit_code == 130 and "Aborted" not in result.output
    assert "interrupted (Ctrl-C)" in result.output and "rerun the same command" in result.output



# Runs in a fresh interpreter (the test process has long imported torch): the help of every command, the
# sub-commands of every group included, then which heavy modules that imported.
HELP_IMPORTS = """
import json, sys
import click
from click.testing import CliRunner
from relicv2.cli.main import cli

def walk(group, path):
    context = click.Context(group)
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        yield [*path, name]
        if isinstance(command, click.Group):
            yield from walk(command, [*path, name])

paths = list(walk(cli, []))
failed = [path for path in paths if CliRunner().invoke(cli, [*path, "--help"]).exit_code != 0]
print(json.dumps({"commands": len(paths), "failed": failed,
                  "heavy": [m for m in ("torch", "torchvision", "nvidia.dali") if m in sys.modules]}))
"""


def test_every_commands_help_imports_no_torch():
    # A command's module is imported only when it runs or shows its help, and those modules import torch inside
    # the job's functions: `--help` costs no torch (nor torch._dynamo, which torchvision imports).
    result = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["commands"] > 20 and seen["failed"] == [], seen
    assert seen["heavy"] == [], seen

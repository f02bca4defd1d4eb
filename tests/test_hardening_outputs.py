"""Jobs never delete what they did not write, and an output they cannot write is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from relicv2.cli.main import cli


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 3.0 - 0.1 * s, "contrastive": 2.0, "invariance": 1.0, "lr": 0.1,
                         "ema": 0.99}) for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_report_refuses_a_figures_folder_it_did_not_create(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    figures = tmp_path / "rep" / "paper-figures"
    figures.mkdir(parents=True)
    (figures / "precious.txt").write_text("mine")
    result = CliRunner().invoke(cli, ["report", "--out", str(tmp_path / "rep" / "paper.html"), "--run", str(run)])
    assert result.exit_code == 1, result.output
    assert "precious.txt" in result.output and "no report wrote" in result.output
    assert (figures / "precious.txt").read_text() == "mine"
    assert not (tmp_path / "rep" / "paper.html").exists()


def test_report_rebuild_removes_only_its_own_figures(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    out = tmp_path / "rep" / "paper.html"
    first = CliRunner().invoke(cli, ["report", "--out", str(out), "--run", str(run)])
    assert first.exit_code == 0, first.output
    figures = out.parent / "paper-figures"
    assert {p.name for p in figures.glob("*.png")} == {"loss.png", "lr.png"}
    again = CliRunner().invoke(cli, ["report", "--out", str(out), "--run", str(run)])
    assert again.exit_code == 0, again.output
    (figures / "notes.txt").write_text("mine")  # a user's file among the figures: the next build refuses
    third = CliRunner().invoke(cli, ["report", "--out", str(out), "--run", str(run)])
    assert third.exit_code == 1 and "notes.txt" in third.output
    assert (figures / "notes.txt").read_text() == "mine" and (figures / "loss.png").is_file()

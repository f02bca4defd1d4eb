"""The reduced demo (`DEMO_REDUCED=1 scripts/demo.sh`): every stage runs, the report has every section,
a second run reuses the finished stages, and the page opens in a real browser with every image loaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from relicv2.evaluation.report.html import SECTIONS
from tests.e2e.background_demo import DEMO, run_demo
from tests.e2e.conftest import open_page

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo() -> tuple[Path, subprocess.CompletedProcess]:
    """The run started in the background when the session began (tests/conftest.py)."""
    result = DEMO.result()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return DEMO.out, result


def test_reduced_demo_report_has_every_section(demo):
    out, result = demo
    page = (out / "report.html").read_text()
    for sid, _ in SECTIONS:
        assert f'<section id="{sid}">' in page
    status: dict[str, str] = {}
    for line in result.stdout.splitlines():  # the report command's "  <section>  <status>" lines
        if line.startswith("  ") and line.split(None, 1)[0] in dict(SECTIONS):
            status.setdefault(*line.split(None, 1))
    # Every stage ran, so every section is filled from the files the stages wrote.
    for sid, _ in SECTIONS:
        assert status[sid] == "ok", f"section {sid}: {status[sid]}"
    assert (out / "eval" / "linear-fast.json").is_file() and (out / "export" / "resnet18.pt").is_file()
    assert "demo finished" in result.stdout and str(out / "report.html") in result.stdout


def test_second_run_reuses_the_finished_stages(demo):
    out, _ = demo
    checkpoints = sorted((out / "run").glob("checkpoint-*.pt"))
    again = run_demo(out)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    for title in ("demo images", "shards", "handcrafted saliency", "saliency network", "mask shards",
                  "ReLICv2 pretraining", "evaluation", "export"):
        line = next(line for line in again.stdout.splitlines() if line.startswith("== ") and title in line)
        assert "done in an earlier run, reused" in line, line
    assert sorted((out / "run").glob("checkpoint-*.pt")) == checkpoints
    assert (out / "report.html").is_file()


def test_demo_report_opens_in_the_browser(demo, browser):
    out, _ = demo
    seen = open_page(browser, out / "report.html")
    assert len(seen["images"]) >= 5  # saliency, views, loss, lr, knn, evaluation
    broken = [image["src"] for image in seen["images"] if not image["complete"] or image["width"] == 0]
    assert not broken, f"images that did not load: {broken}"
    assert not seen["remote"]

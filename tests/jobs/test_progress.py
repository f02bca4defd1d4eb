"""One progress policy: a bar on a terminal; in a log file plain lines with total, rate and ETA, never a
carriage return."""

from __future__ import annotations

import relicv2.jobs.progress
from relicv2.jobs.progress import Phase, tracked


def test_in_a_log_file_progress_is_plain_lines_with_total_rate_and_eta(capsys, monkeypatch):
    monkeypatch.setattr(relicv2.jobs.progress, "LINE_EVERY_S", 0.0)
    with Phase("saliency fused", 4, unit="img", initial=1) as phase:  # resumed: 1 of 4 done before
        for loss in (0.5, 0.25, 0.125):
            phase.set_postfix(loss=loss)
            phase.update()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err
    assert lines[0].startswith("saliency fused: img 2/4 (50%), ") and "ETA " in lines[0] and "loss 0.5" in lines[0]
    assert lines[2].startswith("saliency fused: img 4/4 (100%), ") and "ETA 0:00:00" in lines[2]
    assert lines[3].startswith("saliency fused: 4/4 img(s) in ")


def test_lines_are_spaced_by_the_interval(capsys, monkeypatch):
    monkeypatch.setattr(relicv2.jobs.progress, "LINE_EVERY_S", 3600.0)
    assert list(tracked(range(5), "kNN features val", 10, unit="img")) == [0, 1, 2, 3, 4]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [lines[-1]] and lines[0].startswith("kNN features val: 5/10 img(s) in ")  # only the closing line


def test_a_disabled_phase_prints_nothing(capsys):
    with Phase("pretrain", 3, unit="step", enabled=False) as phase:
        phase.update(3)
    assert capsys.readouterr().err == ""

"""The report's robustness section, from the `robustness.json` of `relicv2 eval robustness`: each corruption
table as a heat map and a table (top-1 per corruption and severity, the mean, CE), the mean over corruptions
(the paper's IN-C) and mCE, and one row per out-of-distribution set. Shown only when such a file is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from relicv2.evaluation.report import plots
from relicv2.evaluation.report.inputs import read_json

SECTION = ("robustness", "Robustness: corruptions and out-of-distribution sets")
PARTS = (("corrupted", "corrupted copies of"), ("imagenet_c", "the released ImageNet-C at"))


def robustness_section(page: Any, path: Path, table: Callable[..., str], notes: Callable[[list[str]], str],
                       fmt: Callable[[object], str]) -> None:
    """Fill the section on `page` (html's `_Page`, with its `_table`, `_notes` and `_fmt`) from `path`; an
    unreadable file is named among the problems and the section says so, never raises."""
    sid = SECTION[0]
    result, problem = read_json(path)
    try:
        if problem is not None:
            raise ValueError(problem)
        body = [notes([f"encoder {result['encoder']}, head {result['head']} ({result['protocol']})"])]
        for key, title in PARTS:
            part = result.get(key)
            if part is None:
                continue
            rows = part["corruptions"]
            severities = list(next(iter(rows.values()))["top1"])
            body.append(table(["corruption", *(f"s{s}" for s in severities), "mean", "CE"],
                              [[name, *(fmt(row["top1"][s]) for s in severities), fmt(row["mean_top1"]), fmt(row["ce"])]
                               for name, row in rows.items()], css=f"robustness-{key}"))
            caption = f"top-1 on {title} {part['source']}"
            body.append(page.img(plots.plot_corruptions(rows, page.figure(f"robustness-{key}.png"), caption), caption))
            baseline = f" against {part['baseline']}" if part.get("baseline") else ""
            body.append(notes([f"mean over corruptions (IN-C): {fmt(part['mean_top1'])}; mCE{baseline}: "
                               f"{fmt(part['mce'])}"]))
        ood = result.get("ood") or {}
        if ood:
            body.append(table(["set", "top-1", "images", "classes", "folder"],
                              [[name, fmt(row["top1"]), fmt(row["num_images"]), fmt(row["classes"]), row["folder"]]
                               for name, row in ood.items()], css="robustness-ood"))
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as error:
        page.summary.problems.append(f"{path}: not a robustness.json of relicv2 eval robustness ({error})")
        return page.not_run(sid, f"{path} could not be read")
    page.ok(sid, "".join(body))

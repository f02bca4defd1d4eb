"""The report's transfer section, from the `transfer.json` files of `relicv2 eval transfer`: one row per file
(the test set, the protocol, the encoder, the chosen settings, the val figure they were chosen on, test top-1
and mean per-class accuracy, how many points were swept). Shown only when such files are given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from relicv2.evaluation.report.inputs import read_json

SECTION = ("transfer", "Transfer: sweep on val, retrain on train + val, score on test (eval transfer)")
COLUMNS = ["test set", "protocol", "encoder", "chosen", "metric", "val", "test top-1", "test mean per-class",
           "points", "train / val / test", "val split"]


def transfer_section(page: Any, paths: list[Path], table: Callable[..., str], notes: Callable[[list[str]], str],
                     fmt: Callable[[object], str]) -> None:
    """Fill the section on `page` (html's `_Page`) from `paths`; an unreadable file is named among the
    problems and left out, never raises."""
    rows = []
    for path in paths:
        result, problem = read_json(path)
        try:
            if problem is not None:
                raise ValueError(problem)
            encoder = result["checkpoint"] or f"random init ResNet-{result['random_init']}"
            chosen = ", ".join(f"{k}={v:g}" for k, v in result["chosen"].items())
            metric, test = result["metric"], result["test"]
            row = [Path(result["inputs"]["test"]).name, result["protocol"], encoder, chosen, metric,
                   fmt(result["val"][metric]), fmt(test["top1"]), fmt(test["mean_per_class"]), fmt(len(result["swept"])),
                   f"{result['num_train']} / {result['num_val']} / {result['num_test']}", result["val_split"]]
            rows.append([str(cell) for cell in row])
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            page.summary.problems.append(f"{path}: not a transfer.json of relicv2 eval transfer ({error})")
    if not rows:
        return page.not_run(SECTION[0], "no readable transfer.json among the given files")
    page.ok(SECTION[0], table(COLUMNS, rows, css="transfer") + notes(
        ["the metric is the figure the sweep maximised on val; the test figures are of the chosen settings only, "
         "retrained on train + val"]))

"""`build_report`: a static HTML page (no server, no script) with its PNG figures in a folder beside it.

Every number and curve is read from what the jobs wrote (metrics.jsonl, the eval commands' `--json`
files, saliency train's report.json, maps and shards), never passed in by the caller. A section whose
inputs are missing says "not run"; an unreadable input is named on the page and left out.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relicv2.evaluation.report import plots
from relicv2.evaluation.report import robustness as robustness_report
from relicv2.evaluation.report import segmentation as segmentation_report
from relicv2.evaluation.report import transfer as transfer_report
from relicv2.evaluation.report.inputs import (
    EvalResult,
    RunMetrics,
    metric_rows,
    protocol_text,
    read_backgrounds,
    read_eval_results,
    read_json,
    read_run_metrics,
    read_saliency_samples,
)
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.progress import clock
from relicv2.pretrain.knn.outcome import named
from relicv2.shards.images import PNG_SIGNATURE

# In the figures folder: the names of the figures the report wrote there, the only files a rebuild removes.
FIGURES_RECORD = ".written-by-report.json"
NO_RUN = "no pretraining run (metrics.jsonl)"
# (id, title) of every section, in page order; tests check that each is present.
SECTIONS = (
    ("summary", "The run at a glance"),
    ("saliency", "Saliency: handcrafted maps vs the network's masks"),
    ("saliency-training", "Saliency network training (saliency train report.json)"),
    ("views", "Augmented views, masked and unmasked"),
    ("training", "Pretraining: loss parts and learning rate over steps"),
    ("knn", "kNN monitor over epochs"),
    ("evaluation", "Evaluation: final figures"),
)
# Sections of the evaluation families, on the page only when their result is given (after SECTIONS).
BACKGROUNDS_SECTION = ("backgrounds", "Backgrounds: does the encoder rely on them? (eval backgrounds)")
OPTIONAL_SECTIONS = (BACKGROUNDS_SECTION, robustness_report.SECTION, transfer_report.SECTION,
                     segmentation_report.SECTION)


@dataclass(frozen=True)
class ReportInputs:
    """Where the report reads from; any of them may be None (its section then says "not run")."""

    run_dir: Path | None = None  # a pretraining output folder (metrics.jsonl, config.yaml)
    eval_json: tuple[Path, ...] = ()  # eval `--json` files, or folders of them
    saliency_report: Path | None = None  # `saliency train` OUT/report.json
    maps_dir: Path | None = None  # `saliency handcrafted` output (MAPS/<method>/<key>.png)
    shards: Path | None = None  # shard set whose images the samples show (masked: with masks)
    views: tuple[Path, ...] = ()  # `pretrain preview-views` PNGs
    backgrounds: Path | None = None  # `eval backgrounds` output folder, or its JSON (its section only when given)
    robustness: Path | None = None  # `eval robustness` OUTPUT/robustness.json (its section only when given)
    segment: tuple[Path, ...] = ()  # `eval segment` segment.json files or folders (its section only when given)
    transfer: tuple[Path, ...] = ()  # `eval transfer` OUTPUT/transfer.json files (their section only when given)
    count: int = 4  # images in the saliency figure
    title: str = "ReLICv2 run report"


@dataclass
class ReportSummary:
    """What was written: the page, its figures, each section's status and the problems met."""

    page: Path
    figures: list[Path] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)  # id -> "ok" or "not run: ..."
    problems: list[str] = field(default_factory=list)


class _Page:
    """Collects sections and figures while the report is built."""

    def __init__(self, out: Path) -> None:
        self.figure_dir = out.parent / f"{out.stem}-figures"
        self.summary = ReportSummary(page=out)
        self.blocks: dict[str, str] = {}
        self.written: list[str] = []

    def figure(self, name: str) -> Path:
        """Where to write figure `name`; recorded before it is written, so a killed build's partial file
        is still this report's to remove."""
        self.written.append(name)
        atomic_write_bytes(self.figure_dir / FIGURES_RECORD, (json.dumps(sorted(set(self.written))) + "\n").encode())
        return self.figure_dir / name

    def img(self, path: Path, alt: str) -> str:
        self.summary.figures.append(path)
        src = f"{self.figure_dir.name}/{path.name}"
        return f'<figure><img src="{html.escape(src)}" alt="{html.escape(alt)}"><figcaption>{html.escape(alt)}</figcaption></figure>'

    def ok(self, section: str, body: str) -> None:
        self.blocks[section] = body
        self.summary.sections[section] = "ok"

    def not_run(self, section: str, why: str) -> None:
        self.blocks[section] = f'<p class="not-run">not run: {html.escape(why)}</p>'
        self.summary.sections[section] = f"not run: {why}"


def build_report(inputs: ReportInputs, out: Path) -> ReportSummary:
    """Write `out` (an .html file) and its figures into `<out stem>-figures/` beside it."""
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report path {out} must end in .html")
    page = _Page(out)
    claim_figure_dir(page.figure_dir)
    page.summary.problems += _missing_inputs(inputs)
    metrics_file = None if inputs.run_dir is None else Path(inputs.run_dir) / "metrics.jsonl"
    # Read once: the summary and the training sections both show the run (312,000 steps at the paper's size).
    metrics = read_run_metrics(inputs.run_dir) if metrics_file is not None and metrics_file.is_file() else None
    results, problems = read_eval_results(list(inputs.eval_json))
    page.summary.problems += problems
    _summary_section(page, metrics_file, metrics, results)
    _saliency_section(page, inputs)
    _saliency_training_section(page, inputs)
    _views_section(page, inputs)
    _training_sections(page, metrics_file, metrics)
    _evaluation_section(page, results)
    if inputs.backgrounds is not None:
        _backgrounds_section(page, inputs)
    if inputs.robustness is not None:
        robustness_report.robustness_section(page, Path(inputs.robustness), _table, _notes, _fmt)
    if inputs.segment:
        segmentation_report.segmentation_section(page, inputs.segment, _table, _notes, _fmt)
    if inputs.transfer:
        transfer_report.transfer_section(page, [Path(p) for p in inputs.transfer], _table, _notes, _fmt)
    atomic_write_bytes(out, _render(page, inputs).encode("utf-8"))
    return page.summary


def claim_figure_dir(folder: Path) -> None:
    """Make `folder` an empty figures folder: create it, or remove the figures an earlier build recorded
    there. A folder holding anything else (a user's files, a build of an older relicv2 that kept no
    record) is refused, never emptied."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ValueError(f"{folder} (the report's figures folder) is not a folder; move it away or choose another --out")
    folder.mkdir(parents=True, exist_ok=True)
    recorded, _ = read_json(folder / FIGURES_RECORD)  # none (a new folder or a user's), or unreadable: nothing is ours
    recorded = {name for name in recorded if isinstance(name, str)} if isinstance(recorded, list) else set()
    entries = [p for p in folder.iterdir() if p.name != FIGURES_RECORD]
    foreign = sorted(p.name for p in entries if p.name not in recorded or p.is_symlink() or not p.is_file())
    if foreign:
        raise ValueError(f"{folder} (the report's figures folder) holds files no report wrote "
                         f"({named(foreign, 3)}); move them away or choose another --out")
    for path in entries:  # only the recorded figures of an earlier build are left
        path.unlink()


def _missing_inputs(inputs: ReportInputs) -> list[str]:
    """The inputs a user named that hold nothing the report can read (a typo reads as "not run" otherwise)."""
    problems = []
    for option, path, wanted in (("--run", inputs.run_dir, "metrics.jsonl"), ("--maps", inputs.maps_dir, None),
                                 ("--shards", inputs.shards, None), ("--saliency-report", inputs.saliency_report, None)):
        if path is None:
            continue
        if not Path(path).exists():
            problems.append(f"{option} {path}: does not exist")
        elif wanted is not None and not (Path(path) / wanted).is_file():
            problems.append(f"{option} {path}: has no {wanted} (not a pretraining output folder)")
    return problems


def _saliency_section(page: _Page, inputs: ReportInputs) -> None:
    if inputs.shards is None or not Path(inputs.shards).is_dir():
        return page.not_run("saliency", "no shard set given (--shards: the masked shards of saliency build-masks)")
    samples, problems = read_saliency_samples(inputs.shards, inputs.maps_dir, inputs.count)
    page.summary.problems += problems
    if not any(s.maps or s.mask is not None for s in samples):
        return page.not_run("saliency", f"no handcrafted map or network mask found for the images of {inputs.shards}")
    figure = plots.plot_saliency(samples, page.figure("saliency.png"))
    notes = []
    if inputs.maps_dir is None:
        notes.append("handcrafted maps: not run (no --maps folder)")
    if not any(s.mask is not None for s in samples):
        notes.append("network masks: not run (the shard set has no mask.png members)")
    page.ok("saliency", page.img(figure, f"{len(samples)} images from {inputs.shards}") + _notes(notes))


def _saliency_training_section(page: _Page, inputs: ReportInputs) -> None:
    if inputs.saliency_report is None or not Path(inputs.saliency_report).is_file():
        return page.not_run("saliency-training", "no saliency train report.json")
    report, problem = read_json(inputs.saliency_report)
    rows, losses = metric_rows(report), _loss_rows(report)  # none of either when unreadable (report None)
    if not rows and not losses:
        page.summary.problems.append(problem or f"{inputs.saliency_report}: no metrics in it")
        return page.not_run("saliency-training", f"{inputs.saliency_report} holds no readable metrics")
    parts = []
    if rows:
        columns = sorted({name for _, values in rows for name in values})
        body = [[name, *(_fmt(values.get(c)) for c in columns)] for name, values in rows]
        parts.append(_table(["", *columns], body, css="saliency"))
    else:
        parts.append("<p>No ground-truth masks were given (<code>--gt</code>), so label and mask quality "
                     "were not scored; the training losses are below.</p>")
    if losses:
        parts.append(_table(["network (method-iteration)", "epochs", "first loss", "last loss"], losses,
                            css="saliency"))
    page.ok("saliency-training", "".join(parts) +
            f"<p class=\"source\">from {html.escape(str(inputs.saliency_report))}</p>")


def _loss_rows(report: object) -> list[list[str]]:
    """Per trained network of `saliency train`: epochs, first and last epoch loss (from "losses")."""
    losses = report.get("losses") if isinstance(report, dict) else None
    if not isinstance(losses, dict):
        return []
    numbers = {name: [v for v in values if isinstance(v, int | float)] for name, values in losses.items()
               if isinstance(values, list)}
    return [[str(name), str(len(n)), _fmt(n[0]), _fmt(n[-1])] for name, n in numbers.items() if n]


def _views_section(page: _Page, inputs: ReportInputs) -> None:
    parts = []
    for index, path in enumerate(inputs.views):
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            page.summary.problems.append(f"{path}: {error}")
            continue
        if not data.startswith(PNG_SIGNATURE):
            page.summary.problems.append(f"{path}: not a PNG file, left out")
            continue
        copy = page.figure(f"views-{index}-{path.stem}.png")
        copy.write_bytes(data)
        parts.append(page.img(copy, f"{path.stem}: rows are images; 4 large then 2 small views; "
                                    "views with the background removed are framed in orange"))
    if not parts:
        return page.not_run("views", "no preview-views PNG")
    page.ok("views", "".join(parts))


def _training_sections(page: _Page, metrics_file: Path | None, metrics: RunMetrics | None) -> None:
    if metrics is None:
        page.not_run("training", NO_RUN)
        return page.not_run("knn", NO_RUN)
    page.summary.problems += metrics.problems
    if metrics.steps:
        last = metrics.steps[-1]
        speed = last.get("images_per_s", last.get("img/s"))
        facts = [f"{len(metrics.steps)} logged steps, last step {last['step']}",
                 f"final loss {_fmt(last.get('loss'))} (contrastive {_fmt(last.get('contrastive'))}, "
                 f"invariance {_fmt(last.get('invariance'))})"]
        if isinstance(speed, int | float):
            facts.append(f"{speed:.1f} images/s at the last logged step")
        facts.append(_masking_fact(metrics))
        page.ok("training", page.img(plots.plot_losses(metrics.steps, page.figure("loss.png")), "loss parts over steps")
                + page.img(plots.plot_schedules(metrics.steps, page.figure("lr.png")),
                           "learning rate and EMA coefficient over steps") + _notes(facts))
    else:
        page.not_run("training", f"{metrics_file} holds no step record")
    if metrics.knn:
        last = metrics.knn[-1]
        knn = metrics.config.get("knn") or {}
        protocol = protocol_text({**{key: knn.get(key) for key in ("crop_size", "k", "temperature")},
                                  "bank": knn.get("train_shards"), "split": knn.get("val_shards")})
        page.ok("knn", page.img(plots.plot_knn(metrics.knn, page.figure("knn.png"), protocol=protocol),
                                "kNN top-1 over epochs")
                + _notes([f"last kNN top-1 {_fmt(last['knn_top1'])} at step {last['step']} ({protocol})"]))
    else:
        page.not_run("knn", f"{metrics_file} holds no kNN record (knn.train_shards / knn.val_shards unset)")


def _summary_section(page: _Page, metrics_file: Path | None, metrics: RunMetrics | None,
                     results: list[EvalResult]) -> None:
    """Model, data, steps, wall time, throughput, data wait and masking of the run, then the final figures
    of the pretrained encoder against random init: what a reader looks at first."""
    if metrics is None or not metrics.steps:
        return page.not_run("summary", NO_RUN if metrics is None else f"{metrics_file} holds no step record")
    config, steps = metrics.config, metrics.steps
    model, data, optim = (config.get(k) or {} for k in ("model", "data", "optim"))
    times = [s["time"] for s in steps if isinstance(s.get("time"), int | float)]
    rows = [["model", f"ResNet-{model.get('depth', '?')}" + (f" x{model['width']}" if model.get("width", 1) != 1 else "")],
            ["data", str(data.get("train_shards") or data.get("source") or "not recorded")],
            ["steps", f"{steps[-1]['step']} (global batch {optim.get('global_batch', '?')})"],
            ["wall time of the logged steps", clock(times[-1] - times[0]) if len(times) > 1 else "-"],
            ["images/s (median)", _fmt(_stat(statistics.median, steps, "images_per_s"))],
            ["data wait a step, s (median)", _fmt(_stat(statistics.median, steps, "data_wait_s"))],
            ["masked fraction of large views (mean)", _fmt(_stat(statistics.fmean, steps, "masked_fraction"))]]
    page.ok("summary", _table(["", ""], rows, css="summary") + _deltas(results))


def _stat(function: Callable[[list[float]], float], steps: list[dict], key: str) -> float | None:
    """`function` (median, mean) of the step records' numbers under `key`; None when none has one."""
    numbers = [s[key] for s in steps if isinstance(s.get(key), int | float)]
    return function(numbers) if numbers else None


def _masking_fact(metrics: RunMetrics) -> str:
    """The masking the run applied per epoch, beside the p_m it was given."""
    p_m = (metrics.config.get("views") or {}).get("mask_probability")
    given = f"views.mask_probability {p_m}" if p_m is not None else "views.mask_probability not recorded"
    per_epoch = metrics.masked_per_epoch()
    if not per_epoch:
        return f"masked fraction of large views: not logged ({given})"
    shown = ", ".join(f"{epoch}: {fraction:.3f}" for epoch, fraction in per_epoch[-10:])
    return f"masked fraction of large views per epoch ({given}): {shown}"


def _evaluation_section(page: _Page, results: list[EvalResult]) -> None:
    if not results:
        return page.not_run("evaluation", "no eval --json result")
    rows = [[r.protocol, protocol_text(r.settings), r.encoder, _fmt(r.top1), _fmt(r.top5), _fmt(r.num_train),
             _fmt(r.num_val), r.path.name] for r in results]
    table = _table(["protocol", "settings", "encoder", "top-1", "top-5", "train images", "val images", "file"], rows,
                   css="evaluation")
    page.ok("evaluation", table + page.img(plots.plot_eval(results, page.figure("evaluation.png")),
                                           "top-1 per protocol") + _deltas(results))


def _backgrounds_section(page: _Page, inputs: ReportInputs) -> None:
    result, rows, problems = read_backgrounds(inputs.backgrounds, inputs.count)
    page.summary.problems += problems
    if result is None:
        return page.not_run("backgrounds", f"{inputs.backgrounds} holds no backgrounds result")
    table = _table(["variant", "top-1", "images"], [[name, _fmt(top1), _fmt(result.get("num_images", {}).get(name))]
                                                    for name, top1 in result["accuracy"].items()], css="backgrounds")
    lines = [f"BG-gap (mixed-same less mixed-rand): {_fmt(result.get('bg_gap'))}"]
    lines += [f"{name}: predictions that follow the background's class: {_fmt(share)}"
              for name, share in (result.get("follows_background") or {}).items()]
    lines.append(f"{_fmt(result.get('images'))} of {_fmt(result.get('num_val'))} val images used; left out: "
                 f"{result.get('excluded') or 'none'}; encoder {result.get('encoder', '-')}, head {result.get('head')}")
    grid = page.img(plots.plot_composites(rows, page.figure("backgrounds.png")), "example composites per variant") \
        if rows else ""
    page.ok("backgrounds", table + _notes(lines) + grid)


def _deltas(results: list[EvalResult]) -> str:
    """One line per protocol and data: the pretrained encoder's gain over random init, only between
    results on the same numbers of train and val images and the same protocol settings (counts that
    differ mean different data, another image size another figure: such a gain would mean nothing)."""
    groups: dict[tuple, list[EvalResult]] = {}
    for result in results:  # what two results must share to be compared: protocol, image counts and settings
        groups.setdefault((result.protocol, result.num_train, result.num_val, protocol_text(result.settings)),
                          []).append(result)
    lines = []
    for (protocol, num_train, num_val, settings), same in sorted(groups.items(), key=lambda item: str(item[0])):
        trained = next((r.top1 for r in same if not r.random_init), None)
        baseline = next((r.top1 for r in same if r.random_init), None)
        if trained is not None and baseline is not None:
            shown = "" if settings == "-" else f"{settings}; "
            lines.append(f"{protocol} ({shown}{_fmt(num_train)} train / {_fmt(num_val)} val images): pretrained "
                         f"{trained:.4f} vs random init {baseline:.4f} ({trained - baseline:+.4f})")
    return _notes(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _notes(lines: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>" if lines else ""


def _table(header: list[str], rows: list[list[str]], css: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
section { border-top: 1px solid #ddd; margin-top: 1.5em; }
figure { margin: 1em 0; } img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; margin: 1em 0; } th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; }
td { font-variant-numeric: tabular-nums; } .not-run { color: #a60; font-style: italic; }
.problems { color: #a00; } .source, .inputs { color: #555; font-size: 0.9em; }
"""


def _render(page: _Page, inputs: ReportInputs) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    given = {"run": inputs.run_dir, "eval": ", ".join(map(str, inputs.eval_json)) or None,
             "saliency report": inputs.saliency_report, "maps": inputs.maps_dir, "shards": inputs.shards,
             "views": ", ".join(map(str, inputs.views)) or None, "backgrounds": inputs.backgrounds,
             "robustness": inputs.robustness, "segment": ", ".join(map(str, inputs.segment)) or None,
             "transfer": ", ".join(map(str, inputs.transfer)) or None}
    sections = [*SECTIONS, *(section for section in OPTIONAL_SECTIONS if section[0] in page.blocks)]
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(inputs.title)}"
             f"</title><style>{STYLE}</style></head><body><h1>{html.escape(inputs.title)}</h1>",
             f"<p class=\"inputs\">built {now} by <code>relicv2 report</code> from: "
             + "; ".join(f"{k} <code>{html.escape(str(v))}</code>" for k, v in given.items() if v) + "</p>",
             "<nav><ul>" + "".join(f'<li><a href="#{sid}">{html.escape(title)}</a></li>' for sid, title in sections)
             + "</ul></nav>"]
    for sid, title in sections:
        parts.append(f'<section id="{sid}"><h2>{html.escape(title)}</h2>{page.blocks[sid]}</section>')
    if page.summary.problems:
        parts.append('<section id="problems"><h2>Inputs left out</h2><ul class="problems">'
                     + "".join(f"<li>{html.escape(p)}</li>" for p in page.summary.problems) + "</ul></section>")
    return "\n".join(parts) + "\n</body></html>\n"

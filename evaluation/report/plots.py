"""The report's figures as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI boxes

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from relicv2.evaluation.report.inputs import EvalResult, SaliencySample, protocol_text  # noqa: E402

LOSS_PARTS = (("loss", "total"), ("contrastive", "contrastive"), ("invariance", "invariance (KL)"))
DPI = 100


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _series(records: Sequence[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[y]) for r in records if isinstance(r.get(x), int | float) and isinstance(r.get(y), int | float)]
    return [p[0] for p in points], [p[1] for p in points]


def plot_losses(steps: Sequence[dict[str, Any]], path: Path) -> Path:
    """Total loss and its two parts over the steps."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in LOSS_PARTS:
        xs, ys = _series(steps, "step", key)
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None)
    ax.set(xlabel="step", ylabel="loss", title="ReLICv2 loss over steps")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_schedules(steps: Sequence[dict[str, Any]], path: Path) -> Path:
    """Learning rate (left axis) and the EMA coefficient of the target network (right axis)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(steps, "step", "lr"), color="tab:blue", label="learning rate")
    ax.set(xlabel="step", title="Schedules over steps")
    ax.set_ylabel("learning rate", color="tab:blue")
    ax.grid(alpha=0.3)
    xs, ys = _series(steps, "step", "ema")
    if xs:
        twin = ax.twinx()
        twin.plot(xs, ys, color="tab:orange", label="EMA coefficient")
        twin.set_ylabel("EMA coefficient", color="tab:orange")
    return _save(fig, path)


def plot_knn(knn: Sequence[dict[str, Any]], path: Path, protocol: str) -> Path:
    """kNN top-1 of the online encoder after each monitored epoch; `protocol` (image size, k, ...) in the title."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(knn, "epoch", "knn_top1"), marker="o")
    ax.set(xlabel="epoch", ylabel="kNN top-1", ylim=(0, 1), title=f"kNN monitor over epochs ({protocol})")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_eval(results: Sequence[EvalResult], path: Path) -> Path:
    """Top-1 per protocol and its settings (one group of bars each: figures of one protocol at other
    settings are other figures), the pretrained encoder next to its random-init baseline."""
    group = {id(r): f"{r.protocol}\n{_short(protocol_text(r.settings), 28)}" for r in results}
    protocols = sorted(set(group.values()))
    # Bars by role: the kNN and linear files may name one checkpoint as a file or as its run folder.
    role = {id(r): r.encoder if r.random_init else "pretrained" for r in results}
    encoders = sorted(set(role.values()), key=lambda e: (e.startswith("random init"), e))
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(protocols) + 2), 4))
    width = 0.8 / max(len(encoders), 1)
    for index, encoder in enumerate(encoders):
        values = [next((r.top1 for r in results if group[id(r)] == p and role[id(r)] == encoder), np.nan)
                  for p in protocols]
        bars = ax.bar(np.arange(len(protocols)) + index * width, values, width, label=_short(encoder))
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(np.arange(len(protocols)) + width * (len(encoders) - 1) / 2, protocols)
    ax.set(ylim=(0, 1.05), ylabel="top-1", title="Evaluation: pretrained vs random init")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def plot_saliency(samples: Sequence[SaliencySample], path: Path) -> Path:
    """One row per image: the image, each handcrafted map, their mean, the network's mask, and the
    image with its background greyed out where the mask is below 0.5 (what masked views show)."""
    methods = sorted({m for s in samples for m in s.maps})
    columns = ["image", *[m.upper() for m in methods]]
    if len(methods) > 1:
        columns.append("mean of maps")
    has_mask = any(s.mask is not None for s in samples)
    if has_mask:
        columns += ["network mask", "background removed"]
    fig, axes = plt.subplots(len(samples), len(columns), figsize=(1.9 * len(columns), 1.9 * len(samples)),
                             squeeze=False)
    for row, sample in enumerate(samples):
        panels: list[np.ndarray | None] = [sample.image, *[sample.maps.get(m) for m in methods]]
        if len(methods) > 1:
            present = [sample.maps[m] for m in methods if m in sample.maps]
            panels.append(np.mean(present, axis=0) if present else None)
        if has_mask:
            panels.append(sample.mask)
            panels.append(None if sample.mask is None
                          else np.where((sample.mask >= 0.5)[..., None], sample.image, np.uint8(128)))
        for col, panel in enumerate(panels):
            ax = axes[row][col]
            ax.set(xticks=[], yticks=[])
            if panel is None:
                ax.text(0.5, 0.5, "missing", ha="center", va="center", transform=ax.transAxes)
            elif panel.ndim == 2:
                ax.imshow(panel, cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(panel)
            if row == 0:
                ax.set_title(columns[col], fontsize=9)
        axes[row][0].set_ylabel(_short(sample.key, 18), fontsize=8)
    return _save(fig, path)


def plot_composites(rows: Sequence[tuple[str, dict[str, np.ndarray]]], path: Path) -> Path:
    """The backgrounds test's composites: one row per image, one column per variant."""
    columns = list(dict.fromkeys(name for _, images in rows for name in images))
    fig, axes = plt.subplots(len(rows), len(columns), figsize=(1.6 * len(columns), 1.7 * len(rows)), squeeze=False)
    for row, (key, images) in enumerate(rows):
        for col, name in enumerate(columns):
            ax = axes[row][col]
            ax.set(xticks=[], yticks=[])
            if name in images:
                ax.imshow(images[name])
            if row == 0:
                ax.set_title(name.replace("_", "-"), fontsize=9)
        axes[row][0].set_ylabel(_short(key, 18), fontsize=8)
    return _save(fig, path)


def plot_corruptions(corruptions: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Top-1 per corruption (rows) and severity (columns, then the mean over severities), as a heat map
    with each figure written in its cell (`corruptions`: a robustness.json table's "corruptions")."""
    names = list(corruptions)
    severities = list(next(iter(corruptions.values()))["top1"])
    values = np.array([[corruptions[n]["top1"].get(s, np.nan) for s in severities] + [corruptions[n]["mean_top1"]]
                       for n in names], dtype=float)
    fig, ax = plt.subplots(figsize=(1.0 * len(severities) + 4, 0.38 * len(names) + 1.6))
    ax.imshow(values, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (row, col), value in np.ndenumerate(values):
        ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8,
                color="white" if value < 0.6 else "black")
    ax.set_xticks(range(len(severities) + 1), [f"severity {s}" for s in severities] + ["mean"], fontsize=8)
    ax.set_yticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)

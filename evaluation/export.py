"""`relicv2 export`: a pretraining checkpoint's encoder as an exported file (format:
`models.encoder_file`), and `load_backbone`, which takes either kind of file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relicv2.evaluation.report.inputs import read_eval_results, read_run_metrics
from relicv2.models.encoder_file import (
    check_output_file,
    exported_network,
    is_encoder_file,
    load_encoder_file,
    read_sidecar,
    save_encoder_file,
)
from relicv2.models.resnet import ResNet
from relicv2.pretrain.checkpoint import (
    checkpoint_config,
    encoder_from_payload,
    load_checkpoint,
    resolve_checkpoint,
)
from relicv2.pretrain.config import trained_protocol
from relicv2.shards.outdir import check_output_file as check_writable
from relicv2.shards.outdir import writing


def load_backbone(path: str | Path, *, network: str = "online") -> tuple[ResNet, dict[str, Any]]:
    """(encoder, description) of an exported file or a pretraining checkpoint / run folder.

    The description: "checkpoint" (the file used), "network", "step" when known, "format", and
    "trained_protocol" (the kNN settings that fit the encoder's training; {} when the file does not
    say). `network="target"` of an exported file holding the online network is an ExportError.
    """
    path = Path(path)
    if is_encoder_file(path):
        encoder = load_encoder_file(path, network=network)
        info = read_sidecar(path)
        views = (info.get("config_summary") or {}).get("views") or {}
        trained = {"crop_size": views["large_size"], "resize_size": 0} if isinstance(views.get("large_size"), int) else {}
        return encoder, {"checkpoint": str(path), "format": f"export-{info['format']}",
                         "network": exported_network(info), "step": info.get("step"), "trained_protocol": trained}
    resolved = resolve_checkpoint(path)
    payload = load_checkpoint(resolved)  # read once: a large run's checkpoint takes seconds
    return encoder_from_payload(payload, resolved, network=network), {
        "checkpoint": str(resolved), "format": "relicv2-checkpoint", "network": network, "step": int(payload["step"]),
        "trained_protocol": trained_protocol(checkpoint_config(payload, resolved))}


def _known_figures(run_dir: Path, step: int) -> dict[str, Any]:
    """The last kNN top-1 logged at or before `step` in the run's metrics.jsonl, and the top-1 of the
    trained encoder's linear results beside it (linear*.json)."""
    figures: dict[str, Any] = {}
    logged = read_run_metrics(run_dir).knn if (run_dir / "metrics.jsonl").is_file() else []
    knn = [r for r in logged if r["step"] <= step]
    if knn:
        figures.update(knn_top1=knn[-1]["knn_top1"], knn_step=knn[-1]["step"])
    results, _ = read_eval_results(sorted(run_dir.glob("linear*.json")))
    figures.update((f"{r.protocol}_top1", r.top1) for r in results if not r.random_init)
    return figures


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, network: str = "online") -> dict[str, Any]:
    """Write the encoder of a pretraining checkpoint (or run folder) as an exported file; return the sidecar.

    An `out` that cannot become the file (a folder, an unwritable place) is refused before the checkpoint
    is read; a failed write (a full disk) is an OutputError naming it, and leaves no partial file."""
    check_output_file(out)
    check_writable(out, "--out")
    resolved = resolve_checkpoint(checkpoint)
    payload = load_checkpoint(resolved)
    config = checkpoint_config(payload, resolved)
    encoder = encoder_from_payload(payload, resolved, network=network)
    step = int(payload["step"])
    sections = {"model": ("depth", "width"),
                "views": ("large_views", "small_views", "large_size", "small_size", "mask_probability"),
                "loss": ("temperature", "num_negatives", "contrast_weight", "invariance_weight"),
                "optim": ("global_batch", "epochs", "base_lr"), "data": ("train_shards",)}
    summary = {section: {name: getattr(getattr(config, section), name) for name in names}
               for section, names in sections.items()}
    metadata = {"source": str(resolved), "network": network, "step": step, "config_summary": summary,
                "figures": _known_figures(resolved.parent, step)}
    with writing(out, "--out", errors=(OSError, RuntimeError)):  # torch.save fails with a RuntimeError
        return save_encoder_file(encoder, out, depth=config.model.depth, width=config.model.width, metadata=metadata)

"""`relicv2 export`: a pretraining checkpoint's encoder as an exported file (format:
`models.encoder_file`: a torch file with a sidecar, or safetensors) or a Hugging Face / timm hub folder
(config.json, model.safetensors, a README.md model card), and `load_backbone`, which takes any of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from relicv2.evaluation.report.inputs import read_eval_results, read_run_metrics
from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.models.checkpoint_file import list_checkpoints
from relicv2.models.encoder_file import (
    HUB_WEIGHTS,
    SAFETENSORS_SUFFIX,
    ExportError,
    check_output_file,
    encoder_file_in,
    exported_network,
    read_encoder_file,
    save_encoder_file,
)
from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.models.resnet import ResNet
from relicv2.pretrain.checkpoint import (
    checkpoint_config,
    encoder_from_payload,
    load_checkpoint,
    resolve_checkpoint,
)
from relicv2.pretrain.config import trained_protocol
from relicv2.shards.outdir import check_output_file as check_writable
from relicv2.shards.outdir import check_output_folder, writing

EXPORT_FORMATS = ("torchvision", "safetensors", "hf-folder")
HUB_CONFIG, HUB_CARD = "config.json", "README.md"  # beside HUB_WEIGHTS in a hub folder
# Who can build each width: torchvision's and timm's ResNets have a 64-channel stem, and their wide_resnet50_2
# widens only the bottlenecks' inner convolutions, so neither holds a ResNet widened in every layer.
WIDE_LOADERS = ("only relicv2 loads it (`relicv2.models.encoder_file.load_encoder_file`, every `relicv2 eval`): "
                "torchvision and timm have no ResNet widened in every layer, stem included (their wide_resnet50_2 "
                "widens the bottlenecks only, and there is no wide_resnet50_4)")


def load_backbone(path: str | Path, *, network: str = "online") -> tuple[ResNet, dict[str, Any]]:
    """(encoder, description) of an exported file (a .pt with its sidecar, a safetensors file, a hub folder)
    or a pretraining checkpoint / run folder.

    The description: "checkpoint" (the file used), "network", "step" when known, "format", and
    "trained_protocol" (the kNN settings that fit the encoder's training; {} when the file does not
    say). `network="target"` of an exported file holding the online network is an ExportError.
    """
    found = encoder_file_in(path)
    if found is not None:
        encoder, info = read_encoder_file(found, network=network)
        views = (info.get("config_summary") or {}).get("views") or {}
        trained = {"crop_size": views["large_size"], "resize_size": 0} if isinstance(views.get("large_size"), int) else {}
        kind = "-safetensors" if found.suffix == SAFETENSORS_SUFFIX else ""
        return encoder, {"checkpoint": str(found), "format": f"export-{info['format']}{kind}",
                         "network": exported_network(info), "step": info.get("step"), "trained_protocol": trained}
    resolved = resolve_checkpoint(Path(path))
    payload = load_checkpoint(resolved)  # read once: a large run's checkpoint takes seconds
    return encoder_from_payload(payload, resolved, network=network), {
        "checkpoint": str(resolved), "format": "relicv2-checkpoint", "network": network, "step": int(payload["step"]),
        "trained_protocol": trained_protocol(checkpoint_config(payload, resolved))}


def _known_figures(run_dir: Path, step: int) -> dict[str, Any]:
    """The last kNN top-1 logged at or before `step` in the run's metrics.jsonl, and the top-1 of the
    trained encoder's evaluation results beside it (its eval JSONs: linear, fine-tuning, kNN)."""
    figures: dict[str, Any] = {}
    logged = read_run_metrics(run_dir).knn if (run_dir / "metrics.jsonl").is_file() else []
    knn = [r for r in logged if r["step"] <= step]
    if knn:
        figures.update(knn_top1=knn[-1]["knn_top1"], knn_step=knn[-1]["step"])
    results, _ = read_eval_results(sorted(run_dir.glob("*.json")))
    figures.update((f"{'knn-eval' if r.protocol == 'knn' else r.protocol}_top1", r.top1)
                   for r in results if not r.random_init)
    return figures


def _weights_path(out: Path, fmt: str) -> Path:
    """Where the weights of a `fmt` export to `out` go; refuses, before any work, an `out` that cannot be it."""
    if fmt == "hf-folder":
        check_output_folder(out, "--out")
        if list_checkpoints(out):
            raise ExportError(f"--out {out} holds pretraining checkpoints; give the hub folder a place of its own, "
                              f"e.g. {out / 'hub'}")
        return out / HUB_WEIGHTS
    if (out.suffix == SAFETENSORS_SUFFIX) != (fmt == "safetensors"):
        fix = (f"name it {out.with_suffix(SAFETENSORS_SUFFIX).name} (timm and Hugging Face pick their reader by "
               "that name)" if fmt == "safetensors" else "add --format safetensors, or name it .pt")
        raise ExportError(f"--out {out} does not fit --format {fmt}: {fix}")
    check_output_file(out)
    check_writable(out, "--out")
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, network: str = "online",
                      fmt: str | None = None) -> dict[str, Any]:
    """Write the encoder of a pretraining checkpoint (or run folder) as an exported file (`fmt` "torchvision",
    "safetensors"; None: safetensors when `out` is named *.safetensors) or a hub folder ("hf-folder");
    return the sidecar.

    An `out` that cannot be written (a folder for a file, an unwritable place) is refused before the
    checkpoint is read; a failed write (a full disk) is an OutputError naming it, and leaves no partial file."""
    out = Path(out)
    fmt = fmt or ("safetensors" if out.suffix == SAFETENSORS_SUFFIX else "torchvision")
    weights = _weights_path(out, fmt)
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
    with writing(out, "--out", errors=(OSError, RuntimeError, SafetensorError)):  # torch.save: RuntimeError
        sidecar = save_encoder_file(encoder, weights, depth=config.model.depth, width=config.model.width,
                                    metadata=metadata)
        if fmt == "hf-folder":  # the weights first: a folder with a card always has its weights
            atomic_write_bytes(out / HUB_CONFIG, (json.dumps(hub_config(sidecar), indent=2) + "\n").encode())
            atomic_write_bytes(out / HUB_CARD, model_card(sidecar).encode())
    return sidecar


def hub_config(sidecar: dict[str, Any]) -> dict[str, Any]:
    """config.json of a hub folder: what timm's `create_model("local-dir:FOLDER")` reads (the architecture,
    no classifier, the input the encoder was trained at), and the sidecar under "relicv2"."""
    size = (sidecar.get("config_summary") or {}).get("views", {}).get("large_size", 224)
    name = sidecar["arch"] if sidecar["width"] == 1 else f"relicv2_{sidecar['arch']}"  # no timm model: refused
    return {"architecture": name, "num_classes": 0, "num_features": sidecar["num_features"], "global_pool": "avg",
            "pretrained_cfg": {"tag": "relicv2", "custom_load": False, "input_size": [3, size, size],
                               "fixed_input_size": False, "interpolation": "bicubic", "crop_pct": 0.875,
                               "crop_mode": "center", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                               "num_classes": 0, "pool_size": [-(-size // 32)] * 2, "first_conv": "conv1",
                               "classifier": "fc"},
            "relicv2": sidecar}


def model_card(sidecar: dict[str, Any]) -> str:
    """README.md of a hub folder: what the encoder is, what it was trained on, its figures, how to load it."""
    summary = sidecar.get("config_summary") or {}
    optim, views = summary.get("optim", {}), summary.get("views", {})
    depth, width, arch = sidecar["depth"], sidecar["width"], sidecar["arch"]
    figures = sidecar.get("figures") or {}
    def label(name: str) -> str:
        return f"kNN monitor (step {figures.get('knn_step')})" if name == "knn_top1" else name.removesuffix("_top1")
    rows = [f"| {label(name)} top-1 | {value:.1%} |" for name, value in figures.items()
            if name.endswith("_top1") and isinstance(value, (int, float))]
    if width == 1:
        weights = f"FOLDER/{HUB_WEIGHTS}"
        load = ("```python\nimport timm, torch, torchvision\nfrom safetensors.torch import load_file\n\n"
                "model = timm.create_model('local-dir:FOLDER', pretrained=True, num_classes=0)  # FOLDER: this one\n"
                f"model = timm.create_model('{arch}', pretrained=True, num_classes=0,\n"
                f"                          pretrained_cfg_overlay=dict(file='{weights}'))\n"
                f"model = torchvision.models.{arch}()\nmodel.fc = torch.nn.Identity()\n"
                f"model.load_state_dict(load_file('{weights}'))\n```\n\n"
                "The weights hold no classifier (`fc`): `num_classes=0` gives the pooled features; add a head "
                "of your own." + (" torchvision has no ResNet-200: load it with timm." if depth == 200 else ""))
    else:
        load = f"A {width}x-wide ResNet-{depth}: {WIDE_LOADERS}."
    lines = ["---", "license: unknown  # set the licence of these weights (mind your pretraining data's terms)",
             f"library_name: {'timm' if width == 1 else 'relicv2'}", "pipeline_tag: image-feature-extraction",
             "tags:", "- image-feature-extraction", "- self-supervised", "- relicv2", "---", "",
             f"# {arch}: a ResNet-{depth} encoder pretrained with ReLICv2 (relicv2)", "",
             "## Model details", "",
             f"- Architecture: ResNet-{depth}, width {width}x"
             f"{' (every layer widened, stem included)' if width > 1 else ''}, {sidecar['num_features']} features, {sidecar.get('padding', 'torch')} padding; no classifier",
             f"- Pretraining data: {summary.get('data', {}).get('train_shards') or 'not recorded'}",
             f"- Pretraining: step {sidecar.get('step')} of a {optim.get('epochs')}-epoch run, global batch "
             f"{optim.get('global_batch')}, {views.get('large_views')} x {views.get('large_size')} px + "
             f"{views.get('small_views')} x {views.get('small_size')} px views",
             f"- Source: {sidecar.get('source', 'not recorded')} ({exported_network(sidecar)} network)",
             "", "## Evaluation", "",
             *(["| figure | value |", "|---|---|", *rows] if rows else
               ["No evaluation figures were found beside the run (metrics.jsonl, eval JSONs)."]), "",
             "## How to load", "", load, "", "## Licence", "",
             "Not set by the export: fill in `license:` above before publishing.", ""]
    return "\n".join(lines)

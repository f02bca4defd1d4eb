"""`relicv2 export` (checkpoint -> plain encoder file) and `relicv2 import-official` (the authors' JAX weights)."""

from __future__ import annotations

from pathlib import Path

import click

from relicv2.cli.options import user_errors

# evaluation.export.EXPORT_FORMATS, written out: a command's --help imports no torch (a test checks they agree)
FORMATS = ("torchvision", "safetensors", "hf-folder")


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True,
              help="Pretraining checkpoint, or a run folder (its newest checkpoint).")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="File to write (torchvision: its JSON sidecar goes to OUT.json), or the hf-folder's folder.")
@click.option("--network", type=click.Choice(["online", "target"]), default="online", show_default=True,
              help="The checkpoint's online encoder (the one the paper evaluates) or its EMA target.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="torchvision: a torch state dict + sidecar; safetensors: one file, the sidecar in its metadata, "
                   "no pickle; hf-folder: config.json, model.safetensors and a README.md model card, the layout "
                   "of the Hugging Face / timm hubs. [default: safetensors for an OUT named *.safetensors, "
                   "else torchvision]")
def export(checkpoint: Path, out: Path, network: str, fmt: str | None) -> None:
    """Write the encoder (torchvision's names; no fc) as a state dict, a safetensors file or a hub folder.

    \b
    relicv2 export --checkpoint runs/imagenette-r18-cpu --out r18.pt
    python -c "import torch, torchvision; m = torchvision.models.resnet18(); \\
               print(m.load_state_dict(torch.load('r18.pt'), strict=False))"   # only fc.* missing
    relicv2 export --checkpoint runs/imagenette-r18-cpu --out r18.safetensors
    relicv2 export --checkpoint runs/imagenette-r18-cpu --out hub/r18 --format hf-folder
    python -c "import timm; m = timm.create_model('local-dir:hub/r18', pretrained=True, num_classes=0)"

    Wider encoders (width 2, 4) load only with relicv2 (its evals, models.encoder_file.load_encoder_file):
    torchvision and timm have no ResNet widened in every layer.
    """
    from relicv2.evaluation.export import HUB_CARD, HUB_CONFIG, WIDE_LOADERS, export_checkpoint
    from relicv2.models.encoder_file import HUB_WEIGHTS, SAFETENSORS_SUFFIX, sidecar_path

    # ValueError: a torch file's error (models.torchfile), a folder as --out among them
    with user_errors(ValueError, path=out):
        sidecar = export_checkpoint(checkpoint, out, network=network, fmt=fmt)
    written = (f"{out} ({HUB_CONFIG}, {HUB_WEIGHTS}, {HUB_CARD})" if fmt == "hf-folder" else
               f"{out}" + (f" and {sidecar_path(out)}" if out.suffix != SAFETENSORS_SUFFIX else ""))
    click.echo(f"wrote {written}: {sidecar['format']} names, {sidecar['arch']}, {network} network, step "
               f"{sidecar['step']}; fc not included")
    if sidecar["width"] > 1:
        click.echo(f"a {sidecar['width']}x-wide encoder: {WIDE_LOADERS}")


@click.command("import-official", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Encoder state dict to write (this project's export format); the sidecar goes to OUT.json.")
@click.option("--params", type=click.Choice(["online", "target"]), default="online", show_default=True,
              help="Which of the release's parameter sets to import.")
def import_official(source: Path, out: Path, params: str) -> None:
    """Convert a released ReLICv2 JAX/haiku checkpoint (a dill pickle) to a PyTorch encoder file.

    The pickle is read with a restricted unpickler that builds arrays of plain numeric dtypes and
    plain containers only; anything else is refused without running it. The encoder runs with
    TensorFlow "SAME" padding so its features equal the JAX model's; torchvision's ResNet pads
    otherwise, so the file holds a 'padding.same_tf' entry (a torchvision load names it) and the
    sidecar says "padding": "same_tf" (load it with models.encoder_file.load_encoder_file).
    """
    from relicv2.models.encoder_file import ExportError, check_output_file
    from relicv2.models.official import OfficialImportError, import_official_checkpoint

    with user_errors(OfficialImportError, ExportError, path=out):
        check_output_file(out)  # before the (large) release file is read
        sidecar = import_official_checkpoint(source, out, network=params)
    click.echo(f"wrote {out} ({sidecar['arch']}, padding {sidecar['padding']}, {sidecar['format']} format) "
               f"from {source}")

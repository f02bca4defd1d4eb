#!/usr/bin/env python3
"""Generate docs/config.md, the configuration reference, from the config dataclasses themselves.

Every key's type and default come from the dataclass fields; its description from the comment on the
field's line in the source (and a comment block just above it). So the reference cannot drift from
the code: `tests/e2e/test_config_reference.py` fails when docs/config.md is not what this script
writes, and `make docs` (or `python scripts/gen_config_reference.py`) regenerates it.

    python scripts/gen_config_reference.py               # write docs/config.md
    python scripts/gen_config_reference.py --check       # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "config.md"

# (title, module, root dataclass, the module's `jobs.config.Presets` attribute, how users set the keys).
JOBS: tuple[tuple[str, str, str, str, str], ...] = (
    ("Pretraining (`relicv2 pretrain`)", "relicv2.pretrain.config", "PretrainConfig", "PRESETS",
     "a preset (`--config NAME`) or a YAML file (`--config FILE.yaml`) with one mapping per section, and "
     "`--set section.key=value` on the command line"),
    ("Saliency network (`relicv2 saliency train`)", "relicv2.saliency.network.config", "SaliencyTrainConfig", "PRESETS",
     "a preset (`--config NAME`; `--preset NAME` is the same) or a YAML file of flat keys (`crf:` and "
     "`thresholds:` are mappings), and `--set key=value` (`--set crf.iterations=3`). `--config` is "
     "required: there is no default preset"),
    ("Linear evaluation (`relicv2 eval linear`)", "relicv2.evaluation.job", "LinearConfig", "LINEAR_PRESETS",
     "a preset (`--config NAME`, default `paper`; `--preset NAME` is the same) or a YAML file, and "
     "`--set key=value`. `relicv2 eval knn` takes the `knn` section of the pretraining config above "
     "(`--k`, `--temperature`, `--crop-size`, `--resize-size`, `--batch-size`)"),
    ("Fine-tuning (`relicv2 eval finetune`)", "relicv2.evaluation.job", "FinetuneConfig", "FINETUNE_PRESETS",
     "a preset (`--config NAME`, default `1pct`; `--preset NAME` is the same) or a YAML file, and "
     "`--set key=value`"),
    ("Segmentation (`relicv2 eval segment`)", "relicv2.evaluation.segment", "SegmentConfig", "PRESETS",
     "a preset (`--config NAME`, default `paper`) or a YAML file, and `--set key=value` (`--set binarise=128`, "
     "`--set train_split=train.txt`). The encoder, `--data`, `--output` and `--device` are options of the command"),
    ("Backgrounds test (`relicv2 eval backgrounds`)", "relicv2.evaluation.background_eval", "BackgroundsConfig",
     "PRESETS", "a preset (`--config NAME`, default `default`) or a YAML file, and `--set key=value` "
     "(`--set variants=original,mixed_same,mixed_rand`). The view (the composites' square side and the centre "
     "crop scored) is the one the `--head` file was trained at"),
    ("Robustness (`relicv2 eval robustness`)", "relicv2.evaluation.robustness", "RobustnessConfig", "PRESETS",
     "a preset (`--config NAME`, default `full`) or a YAML file, and `--set key=value` (lists as "
     "`--set severities=1,3,5`, `--set corruptions=fog,snow`). The sets, the encoder, its head file and the "
     "control are options of the command (`relicv2 eval robustness --help`)"),
    ("Transfer (`relicv2 eval transfer`)", "relicv2.evaluation.transfer", "TransferConfig", "PRESETS",
     "a preset (`--config NAME`, default `paper`) or a YAML file, and `--set key=value` (lists as "
     "`--set learning_rates=0.01,0.1`). The sets, the encoder and `--finetune` are options of the command "
     "(`relicv2 eval transfer --help`); the crop follows the encoder's training unless set"),
)

# Commands set by their options alone (no config dataclass): (module, click command), their options listed from
# the command itself.
COMMANDS: tuple[tuple[str, str], ...] = (("relicv2.cli.export", "export"),)


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its source comment: the block just above the field, then the one on its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    result: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        number = node.lineno - 1
        while number >= 1 and lines[number - 1].strip().startswith("#"):
            above.insert(0, comments.get(number, ""))
            number -= 1
        trailing = comments.get(node.end_lineno or node.lineno, "")
        text = " ".join(part for part in (*above, trailing) if part)
        result[node.target.id] = text.replace("noqa", "").strip()
    return result


def annotations(cls: type) -> dict[str, str]:
    """Field name -> its annotation as written in the source (readable: `bool | None`, `Literal[...]`)."""
    source = textwrap.dedent(inspect.getsource(cls))
    class_node = ast.parse(source).body[0]
    return {node.target.id: ast.unparse(node.annotation) for node in class_node.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def yaml_value(value: Any) -> str:
    """A default as it would be written in a YAML preset."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def section_class(cls: type, field: dataclasses.Field) -> type | None:
    """The dataclass of a nested section field (its default factory), else None."""
    factory = field.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def preset_trees(presets: Any) -> dict[str, dict[str, Any]]:
    """A job's shipped presets (`jobs.config.Presets`): name -> raw tree."""
    return {preset.name: yaml.safe_load(preset.text) or {} for preset in presets.all()}


def preset_value(tree: dict[str, Any], key: str) -> str:
    """The value a preset sets for `section.key`, or "" when it keeps the default."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return ""
        node = node[part]
    return f"`{yaml_value(node)}`"


def render_table(cls: type, prefix: str, presets: dict[str, dict[str, Any]]) -> list[str]:
    comments, types = field_comments(cls), annotations(cls)
    rows = ["| key | type | default | " + "".join(f"{name} | " for name in presets) + "description |",
            "|---|---|---|" + "---|" * len(presets) + "---|"]
    for field in dataclasses.fields(cls):
        if section_class(cls, field) is not None:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        key = f"{prefix}{field.name}"
        cells = [f"`{key}`", f"`{types.get(field.name, '')}`", f"`{yaml_value(default)}`",
                 *(preset_value(tree, key) for tree in presets.values()), comments.get(field.name, "")]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def render_job(title: str, root: type, how: str, presets: Any) -> list[str]:
    trees = preset_trees(presets)
    folder = f"{presets.package.replace('.', '/')}/{presets.folder}"
    lines = [f"## {title}", "", f"`{root.__module__}.{root.__name__}`. Set the keys with {how}. "
             "Unknown keys and values of the wrong type are errors."
             + (f" Preset columns: the value each preset (`{folder}/<name>.yaml`, shipped in the package) sets "
                "(blank: the default)." if trees else ""),
             ""]
    lines += [f"- `{preset.name}`: {preset.purpose}" for preset in presets.all()] + ([""] if trees else [])
    presets = trees
    sections = [(f.name, section_class(root, f)) for f in dataclasses.fields(root) if section_class(root, f)]
    plain = [f for f in dataclasses.fields(root) if not section_class(root, f)]
    if plain:
        lines += render_table(root, "", presets) + [""]
    for name, cls in sections:
        doc = inspect.getdoc(cls) or ""
        generic = doc.startswith(f"{cls.__name__}(")  # dataclass's generated signature, not a docstring
        lines += [f"### `{name}` ({cls.__name__})", ""]
        if doc and not generic:
            lines += [doc.replace("\n\n", "\n").replace("\n", " "), ""]
        lines += render_table(cls, f"{name}.", presets) + [""]
    return lines


def render_command(command: Any) -> list[str]:
    """A command's options as a table, from its click definition (name, values, default, help)."""
    lines = [f"## `relicv2 {command.name}`", "", (command.help or "").split("\n")[0], "",
             "| option | values | default | description |", "|---|---|---|---|"]
    for option in command.params:
        if option.name == "help" or not option.opts:
            continue
        values = " | ".join(option.type.choices) if hasattr(option.type, "choices") else option.type.name.lower()
        default = "required" if option.required else "" if option.default is None else f"`{option.default}`"
        cells = [", ".join(f"`{opt}`" for opt in option.opts), values, default, " ".join((option.help or "").split())]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines + [""]


def render() -> str:
    max_depth = importlib.import_module("relicv2.jobs.config").MAX_DEPTH
    lines = ["# Configuration reference", "",
             "<!-- Generated by scripts/gen_config_reference.py from the config dataclasses; do not edit. "
             "Regenerate with `make docs`. -->", "",
             "Every key of every job's configuration, with its type, default and meaning, as the code "
             "defines them. A preset named with `--config NAME` (shipped inside the package, so the name works "
             "from any directory) or a YAML file given with `--config FILE.yaml` overrides the defaults; "
             "`--set` overrides the preset. Relative paths in a preset are read against the current "
             "directory. A file or `--set` value that uses a YAML alias, nests deeper than "
             f"{max_depth} levels or gives a key twice is refused. Every job prints the resolved settings as "
             "YAML at start and saves them as "
             "`config.yaml` beside its outputs. The user guide (`docs/guide.md`) explains which values "
             "matter for which run.", ""]
    for title, module_name, class_name, presets_name, how in JOBS:
        module = importlib.import_module(module_name)
        lines += render_job(title, getattr(module, class_name), how, getattr(module, presets_name))
    for module_name, name in COMMANDS:
        lines += render_command(getattr(importlib.import_module(module_name), name))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help="file to write (default docs/config.md)")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: regenerate it with `make docs` "
                  "(python scripts/gen_config_reference.py)", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the checkout's packages, also without an installed project
    sys.exit(main())

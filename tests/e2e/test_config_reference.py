"""docs/config.md is generated from the config dataclasses; it must be what the generator writes now."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from relicv2.pretrain.config import PretrainConfig
from tests.paths import REPO

GENERATOR = REPO / "scripts" / "gen_config_reference.py"
REFERENCE = REPO / "docs" / "config.md"


def _generator():
    """The generator script as a module, in this process: the config modules it reads are already imported
    here, where a process of its own would import torch again for them (seconds)."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", GENERATOR)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_config_reference_is_current(capsys):
    assert _generator().main(["--check"]) == 0, capsys.readouterr().err + "\nrun `make docs` and commit docs/config.md"


def test_check_fails_on_a_stale_reference(tmp_path: Path, capsys):
    generator = _generator()
    stale = tmp_path / "config.md"
    stale.write_text(REFERENCE.read_text().replace("`data.train_shards`", "`data.train`"))
    assert generator.main(["--check", "--out", str(stale)]) == 1 and "stale" in capsys.readouterr().err
    assert generator.main(["--out", str(stale)]) == 0
    assert stale.read_text() == REFERENCE.read_text()


def test_reference_lists_every_pretrain_key_with_its_default():
    text = REFERENCE.read_text()
    for section in dataclasses.fields(PretrainConfig):
        config = section.default_factory()
        for field in dataclasses.fields(config):
            assert f"| `{section.name}.{field.name}` |" in text, f"{section.name}.{field.name} missing"
    assert "| `optim.base_lr` | `float` | `0.3` |" in text
    assert "| `views.crop_scale_even` | `tuple[float, float]` | `[0.08, 1.0]` |" in text

"""`relicv2 saliency train` checks every input before it writes anything, names what differs from an
earlier run, refuses ground truth that cannot score the run, and writes strict JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.main import cli
from relicv2.saliency.images import write_png
from relicv2.saliency.network.config import load_saliency_config
from relicv2.saliency.network.report import mask_problem
from relicv2.saliency.network.train import few_images_note
from relicv2.shards import write_shard_set
from tests.saliency.network.conftest import scene_samples
from tests.scenes import synthetic_scene

FAST = ["--preset", "tiny", "--no-progress", "--set", "methods=mc", "--set", "num_images=4",
        "--set", "epochs=1", "--set", "fuse_epochs=1"]


def _train(shards: Path | str, out: Path, *extra: str, backbone: str = "random"):
    return CliRunner().invoke(cli, ["saliency", "train", "--shards", str(shards), "--out", str(out),
                                    "--backbone", backbone, *FAST, *extra])


def _masks(folder: Path, masks: dict[str, np.ndarray]) -> Path:
    for key, mask in masks.items():
        write_png(folder / f"{key}.png", mask)
    return folder


@pytest.fixture
def photos(tmp_path: Path, scene_shards) -> Path:
    """The scenes' photos under the scenes' keys: a --gt folder of pictures, not masks."""
    folder = tmp_path / "photos"
    for i, key in enumerate(scene_shards[1]):
        write_png(folder / f"{key}.png", synthetic_scene(48, 64, seed=i)[0])
    return folder


@pytest.mark.parametrize("case", ["shards", "empty shards", "backbone", "unreadable backbone", "wrong backbone",
                                  "gt", "eval-shards", "gt photos", "gt unmatched"])
def test_a_mistake_is_one_line_naming_the_option_and_leaves_out_untouched(
        tmp_path: Path, scene_shards, photos, case: str) -> None:
    shards, masks = scene_shards
    gt = _masks(tmp_path / "gt", masks)
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.pt").write_bytes(b"not weights")
    torch.save({"conv1.weight": torch.zeros(3, 3, 3, 3)}, tmp_path / "small.pt")
    unmatched = _masks(tmp_path / "other", {f"x{k}": m for k, m in masks.items()})
    out = tmp_path / "out"
    args, expected = {
        "shards": ((tmp_path / "nope", "random"), "--shards"),
        "empty shards": ((tmp_path / "empty", "random"), "no shards"),
        "backbone": ((shards, str(tmp_path / "nope.pt")), "nope.pt does not exist"),
        "unreadable backbone": ((shards, str(tmp_path / "junk.pt")), "junk.pt is not a readable weights file"),
        "wrong backbone": ((shards, str(tmp_path / "small.pt")), "--backbone"),
        "gt": ((shards, "random", "--gt", str(tmp_path / "nope")), "--gt"),
        "eval-shards": ((shards, "random", "--gt", str(gt), "--eval-shards", str(tmp_path / "nope")),
                        "--eval-shards"),
        "gt photos": ((shards, "random", "--gt", str(photos)), "not masks"),
        "gt unmatched": ((shards, "random", "--gt", str(unmatched)), "no mask is named like an image"),
    }[case]
    result = _train(args[0], out, *args[2:], backbone=args[1])
    assert result.exit_code == 1, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()[-1:]) == 1 and result.output.count("Error:") == 1
    assert not out.exists()  # nothing written: the corrected command is not refused later


def test_masks_are_grey_images(tmp_path: Path) -> None:
    rgb, mask = synthetic_scene(48, 64, seed=0)
    write_png(tmp_path / "mask.png", mask)
    Image.fromarray(mask).convert("RGB").save(tmp_path / "mask.jpg", quality=90)  # a colour JPEG of a mask
    palette = Image.fromarray(mask).convert("P")  # grey palette
    palette.save(tmp_path / "palette.png")
    write_png(tmp_path / "photo.png", rgb)
    Image.fromarray(rgb).convert("P").save(tmp_path / "colour-palette.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG broken")
    assert mask_problem(tmp_path / "mask.png") is None
    assert mask_problem(tmp_path / "mask.jpg") is None
    assert mask_problem(tmp_path / "palette.png") is None
    assert "colour image" in mask_problem(tmp_path / "photo.png")
    assert "colour image" in mask_problem(tmp_path / "colour-palette.png")
    assert mask_problem(tmp_path / "broken.png") is not None


def test_a_stale_config_is_replaced_the_note_is_one_line_and_an_unscored_part_is_null(
        tmp_path: Path, scene_shards) -> None:
    shards, masks = scene_shards
    held_samples, _ = scene_samples(2, start=40)  # held-back images without masks in --gt
    write_shard_set(held_samples, tmp_path / "held", max_count=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("inputs: {shards: nope}\n")  # left by an older version's failed check
    result = _train(shards, out, "--gt", str(_masks(tmp_path / "gt", masks)), "--eval-shards", str(tmp_path / "held"))
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "random weights" in line]
    assert len(notes) == 1 and notes[0].startswith("saliency train: note:") and "Warning" not in result.stderr
    report = json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert all(row["count"] == 4 and row["mae"] is not None for row in report["train"].values())
    assert all(row["count"] == 0 and row["mae"] is None for row in report["heldout"].values())
    assert yaml.safe_load((out / "config.yaml").read_text())["inputs"]["shards"] == str(shards)
    assert (out / "model.pt").is_file()


def test_fewer_images_than_num_images_is_one_note_with_the_epochs_for_as_many_steps(
        tmp_path: Path, scene_shards) -> None:
    shards, _ = scene_shards  # 12 images
    result = _train(shards, tmp_path / "out", "--set", "num_images=30", "--set", "epochs=2")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "fewer than num_images" in line]
    assert notes == ["saliency train: note: 12 images, fewer than num_images=30 that the preset's epochs were "
                     "chosen for, so each network takes 40% of those steps; for as many steps: --set epochs=5 "
                     "--set fuse_epochs=3"]
    cpu = load_saliency_config("cpu")
    assert few_images_note(cpu, cpu.num_images) is None  # enough images: no note
    no_phase_one = load_saliency_config("cpu", ["iterations=0"])  # only the fused network's epochs count
    assert few_images_note(no_phase_one, cpu.num_images // 2).endswith(
        f"for as many steps: --set fuse_epochs={2 * cpu.fuse_epochs}")

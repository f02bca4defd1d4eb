"""`saliency build-masks` and model loading refusing what a user can get wrong: foreign files in --out,
files that are not models (one line, no torch advice to load untrusted code), the train folder as
--model, refused jobs leaving no --out behind, and what a rerun reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relicv2.models.checkpoint_file import CHECKPOINT
from relicv2.saliency.network.build_masks import (
    BuildMasksConfig,
    MasksError,
    build_masks,
    format_summary,
)
from relicv2.saliency.network.model_file import ModelFileError, load_model
from relicv2.saliency.network.weights import BackboneError, encoder_state_dict
from relicv2.shards.build import Ranks
from tests.saliency.network.conftest import SquarePredictor


def _config(model: Path, shards: Path, out: Path) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=2, batch_size=3, progress=False)


def test_foreign_files_in_out_are_refused_and_kept(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "masked-000000.tar").write_text("mine\n")
    (out / "notes.txt").write_text("notes\n")
    with pytest.raises(MasksError, match=r"holds files this job did not write \(masked-000000\.tar, notes\.txt\); "
                                         r"choose an empty or new folder"):
        build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (out / "masked-000000.tar").read_text() == "mine\n"
    assert sorted(p.name for p in out.iterdir()) == ["masked-000000.tar", "notes.txt"]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(MasksError, match="a-file is a file; choose an empty or new folder"):
        build_masks(_config(tiny_model, shards, tmp_path / "a-file"), Ranks(), predictor=SquarePredictor())


def test_the_training_folder_is_refused_as_out(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    train_out = tiny_model.parent  # holds model.pt, like a `saliency train` output folder
    (train_out / "maps").mkdir()
    with pytest.raises(MasksError, match=r"did not write \(maps, model\.pt\)"):
        build_masks(_config(tiny_model, shards, train_out), Ranks(), predictor=SquarePredictor())
    assert not (train_out / ".build-masks").exists()


def test_a_user_file_added_to_a_finished_set_is_refused(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "out"
    build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    (out / "notes.txt").write_text("notes\n")
    with pytest.raises(MasksError, match=r"did not write \(notes\.txt\)"):
        build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())


def test_rerun_reports_kept_shards_without_a_rate(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    out = tmp_path / "out"
    first = build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (first["shards_kept"], first["shards_built"]) == (0, 3) and first["images_per_s"] is not None
    (out / ".build-masks" / "000001.done.json").unlink()  # one shard to redo
    second = build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (second["shards_kept"], second["shards_built"]) == (2, 1) and second["written"] == 12
    third = build_masks(_config(tiny_model, shards, out), Ranks(), predictor=SquarePredictor())
    assert (third["shards_kept"], third["shards_built"], third["images_per_s"]) == (3, 0, None)
    text = format_summary(third)
    assert "3 shard(s) kept from an earlier run, 0 built" in text
    assert "None" not in text and "img/s" not in text and "rejected.parquet" not in text  # nothing rejected


def test_summary_points_at_rejected_list(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    summary = build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks(), predictor=SquarePredictor())
    summary["rejected"] = 2
    assert f"why each sample was rejected: {tmp_path / 'out' / 'rejected.parquet'}" in format_summary(summary)


@pytest.mark.parametrize("content", [b"hello\n", b"a: 1\nb: [2]\n", b"model:\n  depth: 50\n", b"", b"\x80",
                                     b"c__builtin__\neval\n."])
def test_a_file_that_is_no_model_is_one_line_without_torch_advice(tmp_path, scene_shards, content) -> None:
    shards, _ = scene_shards
    bogus = tmp_path / "notamodel.pt"
    bogus.write_bytes(content)
    with pytest.raises(ModelFileError) as refused:
        build_masks(_config(bogus, shards, tmp_path / "out"), Ranks())
    message = str(refused.value)
    assert message.startswith(f"{bogus} is not a readable saliency model file (")
    assert message.endswith("pass the model.pt written by `relicv2 saliency train`")
    assert "\n" not in message and "weights_only" not in message and "trust" not in message
    assert not (tmp_path / "out").exists()  # a refused job leaves no --out behind
    with pytest.raises(BackboneError) as refused:
        encoder_state_dict(bogus, 18, 1)
    message = str(refused.value)
    assert "is not a readable weights file" in message and "\n" not in message and "weights_only" not in message


def test_a_pretraining_checkpoint_as_model_is_named_and_leaves_no_out(tmp_path, scene_shards) -> None:
    shards, _ = scene_shards
    checkpoint = tmp_path / "checkpoint-000000010.pt"
    torch.save({"format": CHECKPOINT.tag, "version": 1}, checkpoint)
    with pytest.raises(ModelFileError, match="is a relicv2 pretraining checkpoint, not a saliency model"):
        build_masks(_config(checkpoint, shards, tmp_path / "a" / "out"), Ranks())
    assert not (tmp_path / "a").exists()
    with pytest.raises(ModelFileError, match="does not exist"):
        build_masks(_config(tmp_path / "missing.pt", shards, tmp_path / "b"), Ranks())
    assert not (tmp_path / "b").exists()


def test_the_training_folder_is_accepted_as_model(tmp_path, scene_shards, tiny_model) -> None:
    shards, _ = scene_shards
    _model, info = load_model(tiny_model.parent)
    assert info["input_size"] == 32
    by_folder = build_masks(_config(tiny_model.parent, shards, tmp_path / "a"), Ranks(), predictor=SquarePredictor())
    by_file = build_masks(_config(tiny_model, shards, tmp_path / "b"), Ranks(), predictor=SquarePredictor())
    assert by_folder["written"] == by_file["written"] == 12
    # The same model: the folder's fingerprint is its model.pt's, so either form resumes the other's set.
    build_masks(_config(tiny_model, shards, tmp_path / "a"), Ranks(), predictor=SquarePredictor())
    with pytest.raises(ModelFileError, match=r"is a folder without model\.pt"):
        load_model(tmp_path)

"""Evaluation and export refuse what would give a wrong or silent result, with one line naming the fix.

Mismatched class sets, sets that lose samples while read, `--network target` of an exported file,
a folder as `--out`, and files that are not checkpoints; and what they report when they go on:
undecodable images by key, lost samples by set, figures without float32 noise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import relicv2.pretrain.knn.classify as knn_module
from relicv2.cli.eval import eval_group
from relicv2.cli.main import cli
from relicv2.evaluation.finetune import FinetuneConfig, finetune
from relicv2.evaluation.linear import LinearConfig, LinearResult, evaluate_linear
from relicv2.jobs.config import to_dict
from relicv2.models.encoder_file import sidecar_path
from relicv2.models.heads import build_networks
from relicv2.pretrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from relicv2.pretrain.config import KnnConfig, load_config
from relicv2.pretrain.knn.classes import ClassMismatchError, check_same_classes, class_names
from relicv2.pretrain.knn.classify import KnnResult, evaluate_knn
from relicv2.pretrain.knn.outcome import LostSamplesError
from relicv2.shards import ShardSample, ShardSetError, resolve_shard_set, write_shard_set
from relicv2.shards.build import BuildConfig, build_shards
from relicv2.shards.outdir import INFO_NAME
from tests.evaluation.conftest import PooledPixels, shape_image
from tests.tars import write_tar

CLASSES = ("a", "b", "c", "d")


def _build(root: Path, name: str, classes: tuple[str, ...], per_class: int, seed: int) -> Path:
    """A set from `relicv2 shards build` over class folders (so its info.json records the class names)."""
    rng = np.random.default_rng(seed)
    source = root / f"{name}-images"
    for label, cls in enumerate(CLASSES):
        if cls in classes:
            (source / cls).mkdir(parents=True)
            for i in range(per_class):
                (source / cls / f"{i}.jpg").write_bytes(shape_image(label, rng, size=40))
    build_shards(BuildConfig(input=source, out_dir=root / name, progress=False, min_side=16, workers=1))
    return root / name


@pytest.fixture(scope="module")
def built_sets(tmp_path_factory):
    """(train of classes a-d, val of a-d, val of a, b, d only)."""
    root = tmp_path_factory.mktemp("built")
    return (_build(root, "train", CLASSES, 6, 1), _build(root, "val", CLASSES, 3, 2),
            _build(root, "val3", ("a", "b", "d"), 3, 3))


def _knn_cli(*args: str):
    return CliRunner().invoke(eval_group, ["knn", "--random-init", "18", "--crop-size", "32", "--k", "3",
                                           "--device", "cpu", *args])


def _one_line_error(result) -> str:
    """The error's one line (stderr also holds progress bars and named skipped images before it)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.output.count("Error: ") == 1, result.output
    message = result.output.split("Error: ")[1]
    assert message.count("\n") == 1 and message.endswith("\n"), result.output
    return message


# 1. Class indices that mean different classes ------------------------------------------------------------


def test_a_val_set_of_other_class_folders_is_refused_by_every_evaluation_before_any_work(built_sets, tmp_path,
                                                                                       monkeypatch):
    train, val, val3 = built_sets
    assert class_names(train) == list(CLASSES) and class_names(val3) == ["a", "b", "d"]

    def no_work(*args, **kwargs):
        raise AssertionError("features were extracted before the class check")

    monkeypatch.setattr(knn_module, "extract_features", no_work)
    output = _one_line_error(_knn_cli("--train", str(train), "--val", str(val3)))
    assert f"train set {train} has 4 classes [a, b, c, d], val set {val3} 3 [a, b, d]" in output
    assert "class 2 is 'c' in train, 'd' in val" in output and "same class sub-folders" in output
    monkeypatch.undo()
    common = ["--random-init", "18", "--train", str(train), "--val", str(val3), "--device", "cpu",
              "--set", "epochs=1", "--set", "crop_size=16", "--set", "resize_size=16"]
    for command in (["linear", "--preset", "fast"], ["linear", "--preset", "paper", "--set", "backend=pil"],
                    ["finetune", "--labels", str(tmp_path / "keys.txt")]):
        (tmp_path / "keys.txt").write_text("anything\n")
        result = CliRunner().invoke(eval_group, [*command, *common])
        assert "class 2 is 'c' in train, 'd' in val" in _one_line_error(result), command
    # the library functions refuse too (the kNN monitor calls evaluate_knn)
    with pytest.raises(ClassMismatchError, match="class indices differ"):
        evaluate_knn(PooledPixels(), train, val3, settings=KnnConfig(k=3, crop_size=16))
    with pytest.raises(ClassMismatchError):
        finetune(PooledPixels(), train, val3, {"x"}, FinetuneConfig())


def test_a_folder_without_a_shard_set_is_one_line_exit_1_from_every_evaluation(built_sets, tmp_path):
    train, _, _ = built_sets
    empty = tmp_path / "not-a-set"
    empty.mkdir()
    common = ["--random-init", "18", "--train", str(train), "--val", str(empty), "--device", "cpu"]
    for command in (["knn"], ["linear", "--preset", "fast"], ["finetune", "--labels", str(tmp_path / "keys.txt")]):
        (tmp_path / "keys.txt").write_text("anything\n")
        output = _one_line_error(CliRunner().invoke(eval_group, [*command, *common]))
        assert str(empty) in output, command


def test_sets_of_the_same_class_folders_and_sets_without_names_are_evaluated(built_sets, shape_shards):
    train, val, _ = built_sets
    result = _knn_cli("--train", str(train), "--val", str(val))
    assert result.exit_code == 0, result.output
    assert "24 train, 12 val" in result.output
    # sets written without class names (write_shard_set, plain WebDataset tars) cannot be compared: no refusal
    assert class_names(shape_shards[0]) is None
    check_same_classes(shape_shards[0], val)


def test_the_mismatch_names_the_first_differing_class_of_a_long_list(tmp_path):
    for name, classes in (("train", [f"n{i:04d}" for i in range(1000)]),
                          ("val", [f"n{i:04d}" for i in range(1000) if i != 500])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "images-000000.tar").write_bytes(b"")
        (tmp_path / name / INFO_NAME).write_text(json.dumps({"classes": classes}))
    with pytest.raises(ClassMismatchError) as error:
        check_same_classes(tmp_path / "train", tmp_path / "val")
    message = str(error.value)
    assert "1000 classes [..., n0498, n0499, n0500, n0501" in message and "999 [..., n0498, n0499, n0501" in message
    assert "class 500 is 'n0500' in train, 'n0501' in val" in message and "n0000" not in message


# 2. Samples lost while reading ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged_train(tmp_path_factory):
    """160 labelled samples in 4 tars (one corrupt JPEG among them); the second tar cut short."""
    rng = np.random.default_rng(5)
    samples = [ShardSample(f"k{i:04d}", {"jpg": shape_image(i % 6, rng)}, label=i % 6) for i in range(159)]
    samples.insert(7, ShardSample("broken7", {"jpg": b"\xff\xd8\xff not a jpeg"}, label=1))
    folder = tmp_path_factory.mktemp("damaged") / "train"
    write_shard_set(samples, folder, max_count=40)
    tar = folder / "images-000001.tar"
    os.truncate(tar, tar.stat().st_size // 2)
    return folder


def test_knn_refuses_a_set_that_loses_samples_unless_allowed_and_then_counts_them(damaged_train, shape_shards,
                                                                                tmp_path):
    _, val = shape_shards
    output = _one_line_error(_knn_cli("--train", str(damaged_train), "--val", str(val)))
    assert f"shard set {damaged_train} lost samples while being read (images-000001.tar" in output
    assert f"relicv2 shards verify {damaged_train}" in output and "--allow-lost" in output
    record = tmp_path / "knn.json"
    allowed = _knn_cli("--train", str(damaged_train), "--val", str(val), "--allow-lost", "--json", str(record))
    assert allowed.exit_code == 0, allowed.output
    payload = json.loads(record.read_text())
    assert payload["lost"] > 0 and not payload["lost_uncounted"] and "images-000001.tar" in payload["lost_detail"][0]
    # every one of the 160 samples is either in the bank, named as undecodable, or counted as lost
    assert payload["num_train"] + payload["skipped"] + payload["lost"] == 160
    assert payload["skipped_keys"] == ["broken7"]
    assert f"{payload['lost']} lost while reading" in allowed.stdout
    assert f"warning: shard set {damaged_train} lost samples" in allowed.stderr
    assert "undecodable image(s) left out: broken7" in allowed.stderr
    with pytest.raises(LostSamplesError):  # the library refuses by default (the kNN monitor too)
        evaluate_knn(PooledPixels(), damaged_train, val, settings=KnnConfig(k=3, crop_size=16))


def test_a_damaged_set_is_resolved_once_with_what_it_lost_and_scored_from_that_resolution(damaged_train, shape_shards,
                                                                                         tmp_path, capsys):
    _, val = shape_shards
    with pytest.raises(ShardSetError, match=r"images-000001.idx .* lies beyond the tar"):
        resolve_shard_set(damaged_train)  # its second tar is cut short under its index
    damaged = tmp_path / "damaged"
    shutil.copytree(damaged_train, damaged)
    (damaged / "images-000003.tar").unlink()  # and its last tar is gone
    bank = resolve_shard_set(damaged, allow_lost=True)
    assert [tar.name for tar, _ in bank.lost] == ["images-000003.tar", "images-000001.tar"]
    assert bank.lost[0][1] == "listed in the manifest but missing" and "lies beyond the tar" in bank.lost[1][1]
    assert [tar.name for tar in bank.tars] == ["images-000000.tar", "images-000002.tar"] and bank.samples == 80
    queries, settings = resolve_shard_set(val), KnnConfig(k=3, crop_size=16)
    with pytest.raises(LostSamplesError, match="images-000003.tar: listed in the manifest but missing"):
        evaluate_knn(PooledPixels(), bank, queries, settings=settings)
    assert "broken7" not in capsys.readouterr().err  # refused before any image of the set was decoded
    result = evaluate_knn(PooledPixels(), bank, queries, settings=settings, allow_lost=True)
    (lost,) = result.lost
    assert lost.source == str(damaged) and lost.shards == 2 and lost.counted
    # the remaining samples of the cut-short tar are scored; every sample is scored, skipped or counted lost
    assert 80 < result.num_train + result.skipped < 120 and result.num_train + result.skipped + lost.samples == 160


def test_linear_fast_refuses_a_damaged_set_also_from_features_cached_when_it_was_allowed(damaged_train,
                                                                                       shape_shards, tmp_path):
    _, val = shape_shards
    args = ["linear", "--preset", "fast", "--random-init", "18", "--train", str(damaged_train), "--val", str(val),
            "--set", "epochs=2", "--set", "crop_size=16", "--set", "resize_size=16", "--device", "cpu",
            "--output", str(tmp_path / "out")]
    assert "--allow-lost" in _one_line_error(CliRunner().invoke(eval_group, args))
    allowed = CliRunner().invoke(eval_group, [*args, "--allow-lost", "--json", str(tmp_path / "r.json")])
    assert allowed.exit_code == 0, allowed.output
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["num_train"] + payload["skipped"] + payload["lost"] == 160 and payload["lost"] > 0
    assert f"lost while reading   {payload['lost']}" in allowed.stdout
    assert payload["lost_detail"][0].startswith(f"{damaged_train}: ")
    again = CliRunner().invoke(eval_group, args)  # the features are cached now, the loss with them
    assert "cached features" in _one_line_error(again)
    with pytest.raises(LostSamplesError):
        evaluate_linear(PooledPixels(), damaged_train, val, LinearConfig(protocol="fast", crop_size=16))


# 3. Undecodable images named, figures rounded -------------------------------------------------------------


def test_json_figures_are_rounded_python_floats():
    knn = KnnResult(top1=float(torch.tensor(0.425)), num_train=1, num_val=1, skipped=0)
    assert float(torch.tensor(0.425)) != 0.425  # the float32 noise this guards against
    assert knn.as_json(checkpoint=None, random_init=18)["top1"] == 0.425
    linear = LinearResult("linear-fast", 2 / 3, float(torch.tensor(0.9)), 3, 3, 0, {0: 1 / 3})
    payload = linear.as_json(checkpoint=None, random_init=None)
    assert (payload["top1"], payload["top5"], payload["per_class_top1"]) == (0.666667, 0.9, {"0": 0.333333})
    assert json.dumps(payload["top5"]) == "0.9"


def test_paper_and_finetune_name_their_undecodable_images(shape_shards, tmp_path):
    _, val = shape_shards
    rng = np.random.default_rng(9)
    samples = [ShardSample(f"t{i:03d}", {"jpg": shape_image(i % 6, rng)}, label=i % 6) for i in range(24)]
    # sound in structure (JPEG start and end markers), so only decoding finds it: the DataLoader path
    samples.append(ShardSample("undecodable", {"jpg": b"\xff\xd8\xff" + b"garbage" * 4 + b"\xff\xd9"}, label=2))
    write_shard_set(samples, tmp_path / "train")
    config = LinearConfig(protocol="paper", epochs=2, batch_size=8, crop_size=16, resize_size=16, workers=0,
                                 backend="pil")
    result = evaluate_linear(PooledPixels(), tmp_path / "train", val, config)
    assert result.skipped_keys == ["undecodable"] and result.skipped == 1  # met in both epochs, counted once
    tuned = finetune(PooledPixels(), tmp_path / "train", val, {"t000", "t001", "t002", "undecodable"},
                     FinetuneConfig(epochs=1, batch_size=2, crop_size=16, resize_size=16, workers=0))
    assert tuned.skipped_keys == ["undecodable"] and tuned.num_train == 4
    assert "undecodable" in tuned.as_json(checkpoint=None, random_init=None)["skipped_keys"]


# 4-6. Backbones and exports -------------------------------------------------------------------------------


def _run(folder: Path) -> Path:
    config = load_config(None, ["model.depth=18", "model.hidden_dim=16", "model.out_dim=8"])
    online, target = build_networks(18, 1, hidden_dim=16, out_dim=8)
    save_checkpoint(folder, {"config": to_dict(config), "step": 3, "online": online.state_dict(),
                             "target": target.state_dict(), "optimizer": {}, "rng": [], "data": []}, keep=1)
    (folder / "config.yaml").write_text("version: 1\n")
    return folder / "checkpoint-000000003.pt"


def test_network_target_of_an_exported_encoder_is_refused(tmp_path, shape_shards):
    _run(tmp_path / "run")
    out = tmp_path / "r18.pt"
    assert CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]).exit_code == 0
    train, val = shape_shards
    knn = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(out), "--network", "target", "--train",
                                          str(train), "--val", str(val), "--crop-size", "16", "--device", "cpu"])
    output = _one_line_error(knn)
    assert f"{out} is an exported encoder holding the online network only" in output
    assert "relicv2 export --network target" in output
    linear = CliRunner().invoke(eval_group, ["linear", "--checkpoint", str(out), "--network", "target", "--train",
                                             str(train), "--val", str(val), "--preset", "fast", "--device", "cpu"])
    assert "holding the online network only" in _one_line_error(linear)
    # an export of the target network is what --network target asks for, and is labelled as such
    target = tmp_path / "target.pt"
    assert CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(target),
                                    "--network", "target"]).exit_code == 0
    ok = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(target), "--network", "target", "--train",
                                         str(train), "--val", str(val), "--crop-size", "16", "--device", "cpu"])
    assert ok.exit_code == 0 and f"{target} (target): kNN top-1" in ok.output, ok.output


def test_export_to_an_existing_folder_is_refused_before_any_work(tmp_path):
    _run(tmp_path / "run")
    (tmp_path / "exp").mkdir()
    result = CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "exp")])
    output = _one_line_error(result)
    assert f"--out {tmp_path / 'exp'} is a folder" in output and str(tmp_path / "exp" / "encoder.pt") in output
    assert not list((tmp_path / "exp").iterdir()) and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    release = tmp_path / "release.pkl"
    release.write_bytes(b"never read")
    imported = CliRunner().invoke(cli, ["import-official", str(release), "--out", str(tmp_path / "exp")])
    assert "is a folder" in _one_line_error(imported)


def test_a_file_that_is_not_a_checkpoint_is_named_with_what_to_pass(tmp_path, shape_shards):
    checkpoint = _run(tmp_path / "run")
    train, val = shape_shards
    args = ["--train", str(train), "--val", str(val), "--crop-size", "16", "--device", "cpu"]
    config = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(tmp_path / "run" / "config.yaml"), *args])
    output = _one_line_error(config)
    assert "config.yaml is not a readable relicv2 pretraining checkpoint" in output
    assert "pass a run folder, a checkpoint-*.pt file" in output and "delete it" not in output
    # a run's own damaged checkpoint still gets the advice to delete it (a run resumes from the one before)
    checkpoint.write_bytes(checkpoint.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=r"checkpoint-000000003\.pt is not a readable .*delete it"):
        load_checkpoint(checkpoint)


def test_an_exported_encoder_without_its_sidecar_says_the_sidecar_is_missing(tmp_path, shape_shards):
    _run(tmp_path / "run")
    out = tmp_path / "r18.pt"
    assert CliRunner().invoke(cli, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]).exit_code == 0
    sidecar_path(out).unlink()
    train, val = shape_shards
    result = CliRunner().invoke(eval_group, ["knn", "--checkpoint", str(out), "--train", str(train), "--val",
                                             str(val), "--crop-size", "16", "--device", "cpu"])
    output = _one_line_error(result)
    assert "holds a plain encoder state dict" in output and "sidecar r18.pt.json is missing" in output
    assert "bn1.bias" not in output


def test_pretrain_refuses_a_knn_monitor_of_mismatched_classes_before_training(built_sets, tmp_path):
    from relicv2.pretrain.config import ConfigError
    from relicv2.pretrain.run import run_pretraining
    from tests.pretrain.conftest import tiny_config

    train, _, val3 = built_sets
    config = tiny_config(tmp_path / "run", f"knn.train_shards={train}", f"knn.val_shards={val3}")
    with pytest.raises(ConfigError, match=r"knn\.train_shards / knn\.val_shards: .*class 2 is 'c' in train"):
        run_pretraining(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


# 5. Labels that are no class index, or outside the classes ---------------------------------------------------


def _hostile_label_sets(root: Path, label: bytes) -> tuple[Path, Path]:
    """A plain train and val set (no info.json) of 8 two-class samples each; train's fourth has `label`."""
    rng = np.random.default_rng(0)
    for name in ("train", "val"):
        members = []
        for i in range(8):
            cls = label if name == "train" and i == 3 else str(i % 2).encode()
            members += [(f"k{i}.jpg", shape_image(i % 2, rng)), (f"k{i}.cls", cls)]
        write_tar(root / name / "images-000000.tar", members)
    return root / "train", root / "val"


@pytest.mark.parametrize("label", [b"12345678901234567890", b"7" * 5_000, b"[" * 100_000, b"999999"])
def test_a_hostile_label_is_one_line_from_every_evaluation_before_any_head(label, tmp_path, monkeypatch):
    """A `cls` of 20 digits (past int64), of 5,000 digits or brackets, or one stray class index of 999999
    (a million-class head) is refused by the reader's label rule and the class count, never reaching a DALI
    batch or a head."""
    import relicv2.evaluation.supervised as supervised

    heads = []
    monkeypatch.setattr(supervised, "new_head", lambda *args, **kw: heads.append(args) or pytest.fail("a head"))
    train, val = _hostile_label_sets(tmp_path, label)
    common = ["--random-init", "18", "--train", str(train), "--val", str(val), "--device", "cpu"]
    for command in (["linear", "--preset", "paper", "--set", "backend=dali", "--set", "epochs=1", "--set",
                     "crop_size=16", "--set", "batch_size=4"],
                    ["linear", "--preset", "fast", "--set", "epochs=1", "--set", "crop_size=16"],
                    ["knn", "--crop-size", "16", "--k", "3"]):
        message = _one_line_error(CliRunner().invoke(eval_group, [*command, *common]))
        assert "k3" in message or str(train) in message, message
        if label == b"999999":
            assert "class index 999999, but the sets hold 3 distinct classes" in message
        else:
            assert "not a class index" in message and "relicv2 shards build" in message
    assert heads == []


def test_labels_are_checked_against_the_classes_a_set_declares(built_sets, tmp_path):
    """A built set's info.json names its classes: a label past them is refused even when others are absent."""
    from relicv2.pretrain.knn.classes import class_count
    from relicv2.shards.sample import class_index

    train, val, _ = built_sets
    assert class_count((train, [0, 1]), (val, [1])) == len(CLASSES)  # classes 2 and 3 absent: still 4
    with pytest.raises(ValueError, match=r"train: a sample has class index 4, but its info.json declares 4 classes"):
        class_count((train, [0, 4]), (val, [1]))
    plain_train, plain_val = _hostile_label_sets(tmp_path, b"1")  # no info.json: the classes present count
    assert class_count((plain_train, [0, 2]), (plain_val, [1, 1])) == 3
    with pytest.raises(ValueError, match=r"val: a sample has class index 3, but the sets hold 3 distinct classes"):
        class_count((plain_train, [0, 2]), (plain_val, [3]))
    assert (class_index(b"999999999\n"), class_index(b"1234567890"), class_index(b"-1")) == (999999999, None, None)

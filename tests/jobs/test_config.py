"""The one configuration system (jobs.config): strict keys and types, presets by name, one echo."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.jobs.config import (
    ConfigError,
    Presets,
    RemovedKey,
    build,
    load_yaml,
    parse_overrides,
    removed_settings,
    settings_text,
)
from relicv2.pretrain.config import PRESETS as PRETRAIN_PRESETS
from relicv2.pretrain.config import load_config
from relicv2.saliency.network.config import PRESETS as SALIENCY_PRESETS
from relicv2.saliency.network.config import load_saliency_config
from tests.paths import REPO


@dataclass(frozen=True)
class Inner:
    size: int = 3
    scale: tuple[float, float] = (0.1, 1.0)


@dataclass(frozen=True)
class Outer:
    name: str = "a"
    rate: float = 0.5
    flag: bool | None = None
    names: tuple[str, ...] = ("x", "y")
    weights: dict[str, float] = field(default_factory=lambda: {"x": 1.0, "y": 2.0})
    inner: Inner = field(default_factory=Inner)


def test_overrides_build_a_typed_frozen_tree():
    tree = parse_overrides(["inner.size=5", "rate=1", "flag=true", "names=x,z", "weights.y=3", "inner.scale=[0.2, 1]"])
    config = build(Outer, tree)
    assert config == Outer(rate=1.0, flag=True, names=("x", "z"), weights={"x": 1.0, "y": 3.0},
                           inner=Inner(size=5, scale=(0.2, 1.0)))
    assert isinstance(config.rate, float)


@pytest.mark.parametrize(("override", "message"), [
    ("inner.sise=5", "unknown key inner.sise; valid keys here are: scale, size"),
    ("rat=1", "unknown key rat; valid keys here are: flag, inner, name, names, rate, weights"),
    ("weights.z=1", "unknown key weights.z; valid keys here are: x, y"),
    ("inner.size=2.5", "inner.size must be of type int, got 2.5 (float)"),
    ("rate=fast", "rate must be of type float, got 'fast' (str)"),
    ("flag=3", "flag must be of type bool"),
    ("inner.scale=[1]", "inner.scale must be a list of 2 values"),
    ("name=3", "name must be of type str"),
    ("inner=3", "inner must be a mapping"),
    ("rate", "is not of the form section.key=value"),
])
def test_unknown_keys_and_wrong_types_are_one_clear_error(override, message):
    with pytest.raises(ConfigError) as error:
        build(Outer, parse_overrides([override]), source="--set overrides")
    assert message in str(error.value)


@dataclass(frozen=True)
class Trimmed:
    size: int = 3
    REMOVED_KEYS: ClassVar[dict[str, RemovedKey]] = {"mode": RemovedKey("fast", "fast is the only mode")}


@dataclass(frozen=True)
class Holder:
    trimmed: Trimmed = field(default_factory=Trimmed)


def test_a_removed_key_is_refused_with_the_fix_and_left_out_of_saved_settings():
    for mode in ("fast", "slow"):  # a user who writes the key is told it went, whatever its value
        with pytest.raises(ConfigError) as error:
            build(Holder, {"trimmed": {"size": 4, "mode": mode}}, source="run.yaml")
        assert str(error.value) == "run.yaml: trimmed.mode was removed: fast is the only mode; delete the key"
        # a job's own saved settings record how it ran: read, the key left out
        assert build(Holder, {"trimmed": {"size": 4, "mode": mode}}, saved=True) == Holder(Trimmed(size=4))
    # only a value other than the one that remains is behaviour this version no longer has
    assert removed_settings(Holder, {"trimmed": {"mode": "fast", "size": 4}}) == {}
    assert removed_settings(Holder, {"trimmed": {"mode": "slow"}, "gone": {"mode": "slow"}}) == {
        "trimmed.mode": ("slow", Trimmed.REMOVED_KEYS["mode"])}


def test_unknown_keys_of_every_job_list_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown key optim\.lr; valid keys here are: .*base_lr"):
        load_config("demo-cpu", ["optim.lr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown key epochz; valid keys here are: .*epochs"):
        load_saliency_config("tiny", ["epochz=3"])
    with pytest.raises(ConfigError, match=r"crf\.iterations must be of type int"):
        load_saliency_config("tiny", ["crf.iterations=many"])
    result = CliRunner().invoke(cli, ["eval", "linear", "--random-init", "18", "--train", "t", "--val", "v",
                                      "--config", "fast", "--set", "epoch=3"])
    assert result.exit_code == 2 and "unknown key epoch; valid keys here are: " in result.output, result.output


def test_presets_are_found_by_name_and_say_what_they_are_for():
    assert PRETRAIN_PRESETS.names() == ["demo-cpu", "imagenet-r50-1000ep", "imagenette-r18-cpu"]
    assert SALIENCY_PRESETS.names() == ["cpu", "demo", "paper", "tiny"]
    assert all(preset.purpose for preset in [*PRETRAIN_PRESETS.all(), *SALIENCY_PRESETS.all()])
    assert load_config("imagenet-r50-1000ep").optim.global_batch == 4096
    config = load_saliency_config("cpu", ["epochs=2"])
    assert (config.preset, config.depth, config.epochs) == ("cpu", 18, 2)


def test_an_unknown_preset_is_refused_listing_the_presets(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config("demo")
    text = str(error.value)
    assert "unknown preset 'demo'" in text and "demo-cpu (" in text and "imagenette-r18-cpu (" in text
    with pytest.raises(ConfigError, match=r"does not exist; .*presets: demo-cpu"):
        load_config(tmp_path / "configs" / "demo-cpu.yaml")  # the old place of the presets
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", "s", "--out", str(tmp_path / "o"),
                                      "--config", "laptop", "--backbone", "random"])
    assert result.exit_code == 1 and "unknown preset 'laptop'" in result.output
    assert "tiny (Seconds" in result.output and result.output.count("\n") == 1


def test_saliency_train_without_a_preset_is_refused_naming_each(tmp_path):
    """No silent default to the paper's hours-long run: one line that lists the presets."""
    result = CliRunner().invoke(cli, ["saliency", "train", "--shards", "s", "--out", str(tmp_path / "o"),
                                      "--backbone", "random"])
    assert result.exit_code == 2 and not (tmp_path / "o").exists()
    line = result.output.strip().splitlines()[-1]
    assert "choose the settings with --config NAME" in line
    for preset in SALIENCY_PRESETS.all():
        assert f"{preset.name} ({preset.purpose})" in line
    both = CliRunner().invoke(cli, ["saliency", "train", "--shards", "s", "--out", str(tmp_path / "o"),
                                    "--backbone", "random", "--config", "tiny", "--preset", "cpu"])
    assert both.exit_code == 2 and "give one of them" in both.output


def test_a_preset_file_path_still_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("depth: 34\ncrf:\n  iterations: 2\n")
    config = load_saliency_config(path)
    assert (config.preset, config.depth, config.crf.iterations) == ("mine", 34, 2)
    (tmp_path / "run.yml").write_text("optim:\n  epochs: 70\n")
    assert load_config(str(tmp_path / "run.yml")).optim.epochs == 70


def test_a_preset_by_name_works_from_another_directory(tmp_path):
    """`--config NAME` reads the preset from the package, not from the current directory."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "relicv2", "pretrain", "--config", "imagenette-r18-cpu",
                             "--print-config", "--set", "optim.epochs=2"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"]["depth"] == 18 and printed["optim"]["epochs"] == 2
    assert printed["data"]["train_shards"] == "runs/imagenette/train"  # relative: read against the cwd
    assert list(tmp_path.iterdir()) == []  # printing the settings writes nothing


def test_the_echo_is_yaml_with_the_version_first_then_the_keys_then_the_extras():
    text = settings_text(Outer(), extra={"inputs": {"path": Path("a/b")}}, version="1.2")
    assert text.splitlines()[0] == "version: '1.2'"
    tree = yaml.safe_load(text)
    assert list(tree) == ["version", "name", "rate", "flag", "names", "weights", "inner", "inputs"]
    assert tree["names"] == ["x", "y"] and tree["inputs"] == {"path": "a/b"}
    assert build(Outer, {k: v for k, v in tree.items() if k not in ("version", "inputs")}) == Outer()


def test_presets_of_a_package_without_a_folder_are_none():
    presets = Presets(job="relicv2 nothing", package="jobs")
    assert presets.names() == []
    with pytest.raises(ConfigError, match="unknown preset 'x'; this job ships no presets"):
        presets.get("x")


def test_a_file_that_is_not_text_is_one_clear_error(tmp_path):
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\x80\x81\xff binary")
    with pytest.raises(ConfigError, match=r"weights\.yaml cannot be read \(not UTF-8 text\); pass a YAML file"):
        load_config(path)


LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(4))


@pytest.mark.parametrize(("command", "preset"), [
    (["pretrain", "--print-config", "--output"], "demo-cpu"),
    (["saliency", "train", "--shards", "s", "--backbone", "random", "--out"], "tiny"),
    (["saliency", "build-masks", "--shards", "s", "--model", "m.pt", "--out"], "cpu")])
def test_hostile_yaml_is_one_line_for_every_command(command, preset, tmp_path):
    """Aliases (a billion laughs), nesting past any stack and a repeated key, in a config file or a `--set`
    value, are refused by the one loader naming the file or key, before anything else is read."""
    laughs, deep, twice = (tmp_path / name for name in ("laughs.yaml", "deep.yaml", "twice.yaml"))
    laughs.write_text(LAUGHS)
    deep.write_text("run:\n  output_dir: " + "[" * 50_000 + "]" * 50_000 + "\n")
    twice.write_text("seed: 1\nseed: 2\n")
    flag = "--config"
    cases = [([flag, str(laughs)], f"config file {laughs} uses the alias *a (line 2); settings take no aliases"),
             ([flag, str(deep)], f"config file {deep} nests deeper than 64 levels"),
             ([flag, str(twice)], f"config file {twice} gives the key 'seed' twice (line 2); keep one"),
             ([flag, preset, "--set", "seed=[" + "[" * 30_000], "--set seed nests deeper than 64 levels"),
             ([flag, preset, "--set", "seed=[&a [x, x], *a]"], "--set seed uses the alias *a")]
    for options, message in cases:
        result = CliRunner().invoke(cli, [*command, str(tmp_path / "out"), *options])
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output[-2000:]
        assert result.output.count("\n") <= 2 and message in result.output, result.output[-2000:]
    assert not (tmp_path / "out").exists()


def test_settings_yaml_without_aliases_or_repeats_still_loads():
    assert parse_overrides(["a.b=[1, [2, 3]]", "a.c={x: 1}", "a.d=&anchor 5"]) == {
        "a": {"b": [1, [2, 3]], "c": {"x": 1}, "d": 5}}
    assert load_yaml("a: {b: 1, c: 2}\nd: [1, 2]\n", "f") == {"a": {"b": 1, "c": 2}, "d": [1, 2]}
    assert load_yaml("1: a\n'1': b\n", "f") == {1: "a", "1": "b"}  # an int and a text key are two keys

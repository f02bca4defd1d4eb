"""`relicv2 import-official` under hand-made release pickles: forged dtypes, arrays declared bigger than
the file, malformed releases, and the padding of the files it writes. Every file is written here,
opcode by opcode (`release_pickles`); the hostile ones run the command in a process of its own, so
that a crash fails the test instead of killing the test runner."""

from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from relicv2.cli.main import cli
from relicv2.models.encoder_file import load_encoder_file, save_encoder_file, sidecar_path
from relicv2.models.official import encoder_from_release
from relicv2.models.resnet import resnet
from tests.evaluation.official_fuzz import allowance
from tests.evaluation.release_pickles import (
    RECONSTRUCT,
    Build,
    Call,
    Get,
    Global,
    Put,
    array,
    dtype,
    encode,
    numeric,
    release,
    resnet18_tree,
)
from tests.paths import REPO


def _read_in_subprocess(paths: list[Path]) -> list[dict]:
    """How each file reads (`official_fuzz.read_one`: its one-line error, any foreign object, the bytes
    allocated), in one process of its own; a crash fails here, naming the file it was reading."""
    done = subprocess.run([sys.executable, "-m", "tests.evaluation.official_fuzz", "--files", *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (f"exit status {done.returncode} (-11: a segmentation fault) while reading "
                                  f"{lines[-1] if lines else None}\n{done.stderr[-3000:]}")
    return [line for line in lines if "file" in line]


def _assert_refused(outcomes: list[tuple[Path, dict]], *words: str) -> None:
    for path, outcome in outcomes:
        assert outcome["error"] and outcome["error"].startswith(str(path)), outcome
        assert "\n" not in outcome["error"] and all(word in outcome["error"] for word in words), outcome
        assert outcome["peak"] <= allowance(path.stat().st_size), outcome


def _torso_names(params: dict) -> dict:
    """A ResNet-18 layout of module names around `params` (the modules themselves empty)."""
    names = {f"res_net18/~/block_group_{g}/~/block_{b}/~/conv_0": {} for g in range(4) for b in range(2)}
    return {**names, **params}


# Forged dtypes: numpy's own dtype.__setstate__ and ndarray(...) turn file bytes into object pointers --------

_OBJECT_FLAGS_CLEARED = Build(Call(Global("numpy", "dtype"), ("O8", False, True)), (3, "|", None, None, None, -1, -1, 0))
_STRUCTURED_WITH_OBJECT = dtype("V8", state=(3, "|", None, ("f",), {"f": (_OBJECT_FLAGS_CLEARED, 0)}, 8, 1, 0))
# An object dtype whose has-objects flag is cleared, then ndarray(shape, dtype, buffer, offset, strides) over
# file bytes: copying it (np.ascontiguousarray of the transposed kernel) increfs "objects" at 0x4141...
_FORGED_STEM = Call(Global("numpy", "ndarray"), ((2, 2, 1, 64), _OBJECT_FLAGS_CLEARED, b"\x41" * 2048, 0,
                                                (1024, 512, 512, 8)))


def test_the_forged_dtype_file_gives_one_line_from_the_cli(tmp_path):
    source, out = tmp_path / "forged.pkl", tmp_path / "out.pt"
    source.write_bytes(encode(release(_torso_names({"res_net18/~/initial_conv": {"w": _FORGED_STEM}}))))
    done = subprocess.run([sys.executable, "-m", "relicv2", "import-official", str(source), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, f"exit status {done.returncode} (-11: a segmentation fault)\n{done.stderr}"
    assert done.stderr.startswith(f"Error: {source}: refused") and done.stderr.count("\n") == 1, done.stderr
    assert not out.exists() and not sidecar_path(out).exists()


def _forged_dtype_files(folder: Path) -> list[Path]:
    forged = [
        _FORGED_STEM,
        Call(Global("numpy", "ndarray"), ((2, 2, 1, 64), _STRUCTURED_WITH_OBJECT, b"\x41" * 2048, 0,
                                          (1024, 512, 512, 8))),
        array((2, 2, 1, 64), _OBJECT_FLAGS_CLEARED, b"\x41" * 2048),  # through numpy's own array pickle
        array((2, 2, 1, 64), _STRUCTURED_WITH_OBJECT, b"\x41" * 2048),
        array((2, 2, 1, 64), dtype("f8", state=(3, "|", None, ("f",), {"f": (_OBJECT_FLAGS_CLEARED, 0)}, 8, 1, 0)),
              b"\x41" * 2048),  # a plain name, then a BUILD giving it fields
        Call(Global("numpy.core.multiarray", "scalar"), (_OBJECT_FLAGS_CLEARED, b"\x41" * 8)),
    ]
    paths = []
    for index, stem in enumerate(forged):
        paths.append(folder / f"forged-{index}.pkl")
        paths[-1].write_bytes(encode(release(_torso_names({"res_net18/~/initial_conv": {"w": stem}}))))
    return paths


def _oversized_files(folder: Path) -> list[Path]:
    stride_zero_stem = Call(Global("numpy", "ndarray"), ((7, 7, 3, 64 * 4096), dtype("i1", "|"), b"\x01", 0,
                                                         (0, 0, 0, 0)))
    payloads = [
        encode(release(_torso_names({"res_net18/~/initial_conv": {"w": stride_zero_stem}}))),
        encode(release({"w": Call(Global(*RECONSTRUCT), (Global("numpy", "ndarray"), (10 ** 12,), b"b"))})),
        encode(release({"w": array((7 * 2 ** 40 // 4,), dtype("f4"), b"\x00" * 16)})),  # 7 TiB declared
        b"\x80\x04\x8e" + struct.pack("<Q", 7 * 2 ** 40) + b"\x00" * 16 + b".",  # bytes declared 7 TiB long
        b"\x80\x02N" + b"r" + struct.pack("<I", 2 ** 24) + b".",  # a memo index: the unpickler sizes its memo by it
        b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"Ns.",  # a dict key of tuples nested a million deep
    ]
    paths = []
    for index, payload in enumerate(payloads):
        paths.append(folder / f"large-{index}.pkl")
        paths[-1].write_bytes(payload)
    return paths


@pytest.fixture(scope="module")
def hostile_outcomes(tmp_path_factory) -> dict[str, list[tuple[Path, dict]]]:
    """The forged-dtype and oversized files of the two tests below, read in one process of their own (each
    such process imports torch anew): (file, how it read) for each, by kind."""
    folder = tmp_path_factory.mktemp("hostile")
    files = {"forged": _forged_dtype_files(folder), "oversized": _oversized_files(folder)}
    paths = [path for kind in files.values() for path in kind]
    outcomes = dict(zip(paths, _read_in_subprocess(paths), strict=True))
    return {kind: [(path, outcomes[path]) for path in kind_paths] for kind, kind_paths in files.items()}


def test_every_forged_dtype_is_refused_before_any_array_exists(hostile_outcomes):
    _assert_refused(hostile_outcomes["forged"], "refused")


# Arrays and allocations bigger than the file ----------------------------------------------------------------


def test_nothing_is_allocated_beyond_what_the_file_holds(hostile_outcomes):
    _assert_refused(hostile_outcomes["oversized"])


# Malformed releases: one line naming the file ------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet18_release():
    return resnet18_tree(np.random.default_rng(0))


def _stem_2d(params, state):
    params["res_net18/~/initial_conv"]["w"] = numeric(np.zeros((7, 64), np.float32))


def _stem_of_strings(params, state):
    params["res_net18/~/initial_conv"]["w"] = array((1, 1, 1, 64), dtype("U1"), b"\x00" * 256)


def _key_not_a_string(params, state):
    params[7] = {"w": numeric(np.zeros(3, np.float32))}


def _module_as_a_list(params, state):
    params["res_net18/~/initial_conv"] = [params["res_net18/~/initial_conv"]["w"]]


def _statistics_as_a_list(params, state):
    state["res_net18/~/initial_batchnorm/~/mean_ema"] = [1.0]


def _stem_of_192_channels(params, state):
    params["res_net18/~/initial_conv"]["w"] = numeric(np.zeros((7, 7, 3, 192), np.int8))


def _shortcut_missing(params, state):
    del params["res_net18/~/block_group_1/~/block_0/~/shortcut_conv"]
    del params["res_net18/~/block_group_1/~/block_0/~/shortcut_batchnorm"]


@pytest.mark.parametrize(("damage", "words"), [
    (_stem_2d, ("initial_conv", "(7, 64)", "4-d")),
    (_stem_of_strings, ("refused numpy dtype",)),
    (_key_not_a_string, ("online_params has a key of type int",)),
    (_module_as_a_list, ("initial_conv is a list",)),
    (_statistics_as_a_list, ("mean_ema is a list",)),
    (_stem_of_192_channels, ("192-channel stem",)),
    (_shortcut_missing, ("weights do not fit ResNet-18", "downsample")),
], ids=lambda value: value.__name__.strip("_") if callable(value) else "")
def test_a_malformed_release_gives_one_line_naming_the_file(tmp_path, resnet18_release, damage, words):
    params, state = copy.deepcopy(resnet18_release)
    damage(params, state)
    source = tmp_path / "damaged.pkl"
    source.write_bytes(encode(release(params, state)))
    result = CliRunner().invoke(cli, ["import-official", str(source), "--out", str(tmp_path / "out.pt")])
    assert result.exit_code == 1 and result.output.startswith("Error: "), result.output
    assert result.output.count("\n") == 1 and str(source) in result.output, result.output
    assert all(word in result.output for word in words), result.output


@pytest.mark.parametrize("experiment_state", [
    {"online_params": [], "online_state": {}},
    ["not", "a", "state"],
])
def test_parameters_that_are_no_dict_are_named(tmp_path, experiment_state):
    source = tmp_path / "list.pkl"
    source.write_bytes(encode({"experiment_state": experiment_state}))
    result = CliRunner().invoke(cli, ["import-official", str(source), "--out", str(tmp_path / "out.pt")])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert f"{source}: experiment_state has no online_params / online_state dicts" in result.output


@pytest.mark.parametrize("step", ["1000", 1.5, [1000]])
def test_a_step_that_is_no_integer_is_named(tmp_path, resnet18_release, step):
    source = tmp_path / "step.pkl"
    source.write_bytes(encode(release(*resnet18_release, step=step)))
    result = CliRunner().invoke(cli, ["import-official", str(source), "--out", str(tmp_path / "out.pt")])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert f"{source}: 'step' is a {type(step).__name__}, not an integer" in result.output


def test_one_array_standing_for_many_parameters_is_refused(tmp_path, resnet18_release):
    """A pickle can name an object again for five bytes: one 512x512 kernel kept in the memo and named by
    every 3x3 convolution of the last group would become a float32 copy for each."""
    params, state = copy.deepcopy(resnet18_release)
    kernel = "res_net18/~/block_group_3/~/block_0/~/conv_1"
    params[kernel]["w"] = Put(params[kernel]["w"], 0)
    for name in ("block_1/~/conv_0", "block_1/~/conv_1"):
        params[f"res_net18/~/block_group_3/~/{name}"]["w"] = Get(0)
    source = tmp_path / "shared.pkl"
    source.write_bytes(encode(release(params, state)))
    result = CliRunner().invoke(cli, ["import-official", str(source), "--out", str(tmp_path / "out.pt")])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert f"{source}: the parameters hold more values than the file has bytes" in result.output


def test_a_hand_made_release_of_every_dtype_and_layout_imports(tmp_path, resnet18_release):
    """The forms numpy writes and this reader accepts: protocol 2's latin-1 text for bytes, big-endian and
    Fortran-ordered arrays, a numpy scalar as the step; the stem checked value by value."""
    params, state = copy.deepcopy(resnet18_release)
    kernel = np.random.default_rng(1).normal(0, 1, (7, 7, 3, 64)).astype(">f8")
    raw = np.asfortranarray(kernel).tobytes(order="F")
    params["res_net18/~/initial_conv"]["w"] = array(
        kernel.shape, dtype("f8", ">"), Call(Global("_codecs", "encode"), (raw.decode("latin1"), "latin1")),
        fortran=True)
    step = Call(Global("numpy.core.multiarray", "scalar"), (dtype("i8"), struct.pack("<q", 1234)))
    source = tmp_path / "release.pkl"
    source.write_bytes(encode(release(params, state, step=step)))
    encoder, info = encoder_from_release(source)
    assert info == {"depth": 18, "width": 1, "step": 1234}
    assert torch.equal(encoder.conv1.weight, torch.from_numpy(kernel.transpose(3, 2, 0, 1).astype(np.float32)))
    assert not encoder.conv1.weight.is_meta and encoder.conv1.weight.data_ptr() != 0


# Padding: the written file pads like TensorFlow, which torchvision cannot ----------------------------------


def test_an_encoder_that_pads_like_tensorflow_says_so_to_torchvision_and_to_its_loader(tmp_path):
    import torchvision

    encoder = resnet(18, padding="same_tf").eval()
    out = tmp_path / "r18.pt"
    sidecar = save_encoder_file(encoder, out, depth=18, width=1)
    assert sidecar["format"] == "torchvision" and sidecar["padding"] == "same_tf" and "padding_note" in sidecar
    images = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        expected = encoder(images)
        assert torch.equal(load_encoder_file(out).eval()(images), expected)
    state = torch.load(out, weights_only=True)
    with pytest.raises(RuntimeError, match="padding"):
        torchvision.models.resnet18().load_state_dict(state)
    plain = torchvision.models.resnet18()
    loaded = plain.load_state_dict(state, strict=False)
    assert loaded.unexpected_keys == ["padding.same_tf"]
    plain.fc = torch.nn.Identity()
    with torch.no_grad():  # what the entry warns of: the same weights give other features
        assert not torch.allclose(plain.eval()(images), expected, rtol=1e-3, atol=1e-3)
    info = json.loads(sidecar_path(out).read_text())
    sidecar_path(out).write_text(json.dumps({**info, "padding": "torch"}))
    with pytest.raises(ValueError, match="padding"):
        load_encoder_file(out)
    plain_file = tmp_path / "plain.pt"
    assert "padding_note" not in save_encoder_file(resnet(18), plain_file, depth=18, width=1)
    assert "padding.same_tf" not in torch.load(plain_file, weights_only=True)

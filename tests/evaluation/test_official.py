"""Import of the authors' JAX/haiku ReLICv2 releases: parity with a haiku torso, refusal of code payloads."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from relicv2.models.encoder_file import load_encoder_file
from relicv2.models.official import (
    OfficialImportError,
    encoder_from_release,
    import_official_checkpoint,
)
from tests.evaluation.haiku_releases import write_release

# jax, dm-haiku and dill are test-only extras (requirements-dev.lock); looked for, not imported: the JAX side runs
# in a process of its own (`tests.evaluation.haiku_releases`).
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("jax", "haiku", "dill")),
                                reason="jax, dm-haiku and dill are test-only extras (requirements-dev.lock)")


@pytest.fixture(scope="module")
def jax_process():
    """A spawned process for the JAX side: JAX's threads never start in the test process, which forks worker
    processes in later tests (a fork of a process running JAX's threads can deadlock)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _compare(path, images, expected, tmp_path):
    encoder, info = encoder_from_release(path)
    encoder.eval()
    with torch.no_grad():
        ours = encoder(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() / scale < 1e-4
    return encoder, info


@pytest.mark.slow
def test_resnet50_release_gives_the_jax_features(tmp_path, jax_process):
    path, images, expected = jax_process.submit(write_release, tmp_path, (3, 4, 6, 3), True, 1, 224, "res_net50").result()
    _, info = _compare(path, images, expected, tmp_path)
    assert (info["depth"], info["width"], info["step"]) == (50, 1, 1000)
    out = tmp_path / "r50.pt"
    sidecar = import_official_checkpoint(path, out)
    assert sidecar["format"] == "torchvision" and sidecar["padding"] == "same_tf"
    assert json.loads((tmp_path / "r50.pt.json").read_text())["arch"] == "resnet50"
    import torchvision

    # torchvision pads the stem, max-pool and strided convolutions symmetrically, so its network would give
    # other features: the file's padding entry makes a plain torchvision load say so.
    reference = torchvision.models.resnet50()
    missing = reference.load_state_dict(torch.load(out, weights_only=True), strict=False)
    assert sorted(missing.missing_keys) == ["fc.bias", "fc.weight"] and missing.unexpected_keys == ["padding.same_tf"]
    loaded = load_encoder_file(out).eval()
    with torch.no_grad():
        again = loaded(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    assert np.abs(again - expected).max() / np.abs(expected).max() < 1e-4


@pytest.mark.slow
def test_wide_and_resnet18_shaped_releases_with_a_device_axis(tmp_path, jax_process):
    path, images, expected = jax_process.submit(write_release, tmp_path, (3, 4, 6, 3), True, 2, 64, "res_net50",
                                                device_axis=True).result()
    _, info = _compare(path, images, expected, tmp_path)
    assert (info["depth"], info["width"]) == (50, 2)
    path, images, expected = jax_process.submit(write_release, tmp_path, (2, 2, 2, 2), False, 1, 57, "res_net18",
                                                projection=(False, True, True, True)).result()
    _, info = _compare(path, images, expected, tmp_path)
    assert (info["depth"], info["width"]) == (18, 1)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_a_code_payload_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"experiment_state": _Payload(marker), "step": 1}, protocol=2))
    with pytest.raises(OfficialImportError, match="refused to load global"):
        encoder_from_release(evil)
    assert not marker.exists()
    import dill

    function = tmp_path / "function.pkl"
    function.write_bytes(dill.dumps({"experiment_state": lambda: 1}, protocol=2))
    with pytest.raises(OfficialImportError, match="refused"):
        encoder_from_release(function)
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(OfficialImportError, match="junk.pkl"):
        encoder_from_release(junk)


def test_import_official_cli_refuses_a_payload_with_one_clear_error(tmp_path):
    from click.testing import CliRunner

    from relicv2.cli.main import cli

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"experiment_state": _Payload(marker)}, protocol=2))
    result = CliRunner().invoke(cli, ["import-official", str(evil), "--out", str(tmp_path / "x.pt")])
    assert result.exit_code != 0 and "refused to load global posix.system" in result.output
    assert not marker.exists() and not (tmp_path / "x.pt").exists()

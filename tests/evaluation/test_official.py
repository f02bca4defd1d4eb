"""Import of the authors' JAX/haiku ReLICv2 releases: parity with a haiku torso, refusal of code payloads."""

from __future__ import annotations

import collections
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

jax = pytest.importorskip("jax", reason="jax is a test-only extra (requirements-dev.lock)")
hk = pytest.importorskip("haiku", reason="dm-haiku is a test-only extra (requirements-dev.lock)")
dill = pytest.importorskip("dill", reason="dill is a test-only extra (requirements-dev.lock)")
jnp = jax.numpy

# The release's experiment state: BYOL/ReLICv2 field order.
ExperimentState = collections.namedtuple(
    "_ReLICv2ExperimentState", "online_params target_params online_state target_state opt_state")


def _torso(blocks, bottleneck: bool, width: int, name: str, projection=(True, True, True, True)):
    """A haiku ResNet v1 torso built as the authors' `ResNetTorso` builds it (SAME padding, BlockGroups)."""
    channels = (256, 512, 1024, 2048) if bottleneck else (64, 128, 256, 512)
    bn = {"decay_rate": 0.9, "eps": 1e-5, "create_scale": True, "create_offset": True}

    def forward(images, is_training):
        return _Torso(blocks, bottleneck, width, channels, bn, projection, name=name)(images, is_training)

    return hk.transform_with_state(forward)


class _Torso(hk.Module):
    def __init__(self, blocks, bottleneck, width, channels, bn, projection, name):
        super().__init__(name=name)
        self.stem = hk.Conv2D(64 * width, 7, stride=2, with_bias=False, padding="SAME", name="initial_conv")
        self.stem_bn = hk.BatchNorm(name="initial_batchnorm", **bn)
        self.groups = [hk.nets.ResNet.BlockGroup(channels=width * channels[i], num_blocks=blocks[i],
                                                 stride=(1, 2, 2, 2)[i], bn_config=bn, resnet_v2=False,
                                                 bottleneck=bottleneck, use_projection=projection[i],
                                                 name=f"block_group_{i}") for i in range(4)]

    def __call__(self, x, is_training):
        x = jax.nn.relu(self.stem_bn(self.stem(x), is_training))
        x = hk.max_pool(x, window_shape=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME")
        for group in self.groups:
            x = group(x, is_training, False)
        return jnp.mean(x, axis=(1, 2))


def _randomise(tree, rng: np.random.Generator):
    """Non-trivial weights and BN statistics (scale ~1, variances in [0.5, 2], shifted means)."""
    out = {}
    for module, entries in tree.items():
        out[module] = {}
        for key, spec in entries.items():
            shape, dtype = spec.shape, spec.dtype
            if key == "w":  # float32 draws: 3x faster than float64 for the 94 M weights of a ResNet-50 2x
                new = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2 / int(np.prod(shape[:-1]))))
            elif key == "scale":
                new = rng.uniform(0.5, 1.5, shape)
            elif key == "offset":
                new = rng.normal(0, 0.1, shape)
            elif key in ("average", "hidden") and module.endswith("var_ema"):
                new = rng.uniform(0.5, 2.0, shape)
            elif key in ("average", "hidden"):
                new = rng.normal(0, 0.2, shape)
            else:
                new = np.zeros(shape)
            out[module][key] = np.asarray(new, dtype=dtype)
    return out


def _release(tmp_path, blocks, bottleneck, width, size, name, projection=(True, True, True, True),
             device_axis=False):
    model = _torso(blocks, bottleneck, width, name, projection)
    images = np.random.default_rng(1).normal(0, 1, (2, size, size, 3)).astype(np.float32)
    # Shapes only (no computation), then random values: much faster than running haiku's init.
    params, state = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, True), images)
    rng = np.random.default_rng(2)
    params, state = _randomise(params, rng), _randomise(state, rng)
    features, _ = jax.jit(model.apply, static_argnums=4)(params, state, None, images, False)
    online_params = {**params, "projector/~/linear": {"w": np.zeros((4, 4), np.float32)}}  # heads are ignored
    if device_axis:
        online_params = jax.tree_util.tree_map(lambda a: np.asarray(a)[None], online_params)
        state = jax.tree_util.tree_map(lambda a: np.asarray(a)[None], state)
    release = {"experiment_state": ExperimentState(online_params, online_params, state, state, ()),
               "step": np.int64(1000), "rng": np.zeros(2, np.uint32)}
    path = tmp_path / f"{name}.pkl"
    with open(path, "wb") as handle:
        dill.dump(release, handle, protocol=2)
    return path, images, np.asarray(features)


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


def test_resnet50_release_gives_the_jax_features(tmp_path, jax_process):
    path, images, expected = jax_process.submit(_release, tmp_path, (3, 4, 6, 3), True, 1, 224, "res_net50").result()
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


def test_wide_and_resnet18_shaped_releases_with_a_device_axis(tmp_path, jax_process):
    path, images, expected = jax_process.submit(_release, tmp_path, (3, 4, 6, 3), True, 2, 64, "res_net50",
                                                device_axis=True).result()
    _, info = _compare(path, images, expected, tmp_path)
    assert (info["depth"], info["width"]) == (50, 2)
    path, images, expected = jax_process.submit(_release, tmp_path, (2, 2, 2, 2), False, 1, 57, "res_net18",
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

"""Release files as the authors' JAX/haiku code writes them, for the import-official parity tests.

`write_release` runs in a process of its own (`tests.evaluation.test_official`'s `jax_process`); this module
imports neither torch nor the project, and jax and haiku only when it runs, so that process starts in a
fraction of the time and the test modules that name it do not import jax at collection.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

# The release's experiment state: BYOL/ReLICv2 field order.
ExperimentState = collections.namedtuple(
    "_ReLICv2ExperimentState", "online_params target_params online_state target_state opt_state")


def _torso(blocks, bottleneck: bool, width: int, name: str, projection=(True, True, True, True)):
    """A haiku ResNet v1 torso built as the authors' `ResNetTorso` builds it (SAME padding, BlockGroups)."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    channels = (256, 512, 1024, 2048) if bottleneck else (64, 128, 256, 512)
    bn = {"decay_rate": 0.9, "eps": 1e-5, "create_scale": True, "create_offset": True}

    class Torso(hk.Module):
        def __init__(self):
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

    return hk.transform_with_state(lambda images, is_training: Torso()(images, is_training))


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


def write_release(tmp_path: Path, blocks, bottleneck, width, size, name, projection=(True, True, True, True),
                  device_axis=False):
    """(release file, images [2, size, size, 3], the haiku torso's features of them) for a random torso."""
    import dill
    import jax

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

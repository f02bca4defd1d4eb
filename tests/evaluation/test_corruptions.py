"""The ImageNet-C corruptions: the same image for the same (seed, key, corruption, severity) whatever the
order or process, another for another seed, fidelity lost as the severity grows; one install of cv2."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata

import numpy as np
import pytest

from relicv2.evaluation.corruptions import CORRUPTIONS, CorruptionError, corrupt_image
from tests.paths import REPO


def _photo(seed: int = 0, size: int = 64) -> np.ndarray:
    """A crop of a photo bundled with scikit-image (no download), a different crop per seed."""
    from skimage import data, transform

    image = data.astronaut()
    top, left = 40 * seed, 60 + 30 * seed
    crop = image[top : top + 256, left : left + 256]
    return (transform.resize(crop, (size, size), anti_aliasing=True) * 255).round().astype(np.uint8)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _all(keys_and_images, corruption: str, severity: int, seed: int) -> list[np.ndarray]:
    return [corrupt_image(image, corruption, severity, seed=seed, key=key) for key, image in keys_and_images]


def _in_worker(args) -> np.ndarray:
    image, corruption, severity, seed, key = args
    np.random.seed(12345)  # a worker's own global state must not matter
    return corrupt_image(image, corruption, severity, seed=seed, key=key)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupted_image_depends_on_seed_key_corruption_and_severity_only(corruption):
    images = [(f"k{i}", _photo(i)) for i in range(3)]
    forward = _all(images, corruption, 3, seed=7)
    np.random.seed(99)  # the caller's global generator state does not leak in ...
    state = np.random.get_state()
    backward = _all(images[::-1], corruption, 3, seed=7)[::-1]
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward, strict=True))
    assert np.array_equal(np.random.get_state()[1], state[1])  # ... and is left as it was
    assert all(image.shape == out.shape and out.dtype == np.uint8 for (_, image), out in zip(images, forward, strict=True))


def test_the_same_image_comes_out_of_another_process_and_another_seed_differs():
    image = _photo(1)
    jobs = [(image, name, 2, 5, "key-a") for name in ("gaussian_noise", "glass_blur", "impulse_noise", "frost")]
    here = [corrupt_image(*job[:3], seed=job[3], key=job[4]) for job in jobs]
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as pool:
        there = list(pool.map(_in_worker, jobs))
    assert all(np.array_equal(a, b) for a, b in zip(here, there, strict=True))
    for name, kept in zip(("gaussian_noise", "glass_blur", "impulse_noise", "frost"), here, strict=True):
        other_seed = corrupt_image(image, name, 2, seed=6, key="key-a")
        other_key = corrupt_image(image, name, 2, seed=5, key="key-b")
        assert not np.array_equal(kept, other_seed), name
        assert not np.array_equal(kept, other_key), name


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_fidelity_falls_as_the_severity_grows(corruption):
    from skimage.metrics import structural_similarity

    image = _photo(2)
    outs = {s: [corrupt_image(image, corruption, s, seed=seed, key="k") for seed in range(3)] for s in (1, 3, 5)}
    psnr = [np.mean([_psnr(image, out) for out in outs[s]]) for s in (1, 3, 5)]
    ssim = [np.mean([structural_similarity(image, out, channel_axis=2) for out in outs[s]]) for s in (1, 3, 5)]
    assert ssim[0] > ssim[1] > ssim[2] and ssim[0] < 0.97, (corruption, ssim)
    # Frost's severity 1 adds frost at 0.4 to the whole image and later ones darken the image as they add
    # more: its PSNR against the original is not monotone, its structural similarity is.
    if corruption != "frost":
        assert psnr[0] > psnr[1] > psnr[2], (corruption, psnr)


def test_bad_requests_give_one_line():
    image = _photo()
    for call, words in [
        (lambda: corrupt_image(image, "rain", 1, seed=0, key="k"), "unknown corruption 'rain'"),
        (lambda: corrupt_image(image, "fog", 6, seed=0, key="k"), "severity 6"),
        (lambda: corrupt_image(image[:20], "fog", 1, seed=0, key="k"), "at least 32 px"),
        (lambda: corrupt_image(image.astype(np.float32), "fog", 1, seed=0, key="k"), "float32"),
    ]:
        with pytest.raises(CorruptionError, match=words) as info:
            call()
        assert "\n" not in str(info.value)


def test_one_opencv_is_installed_the_headless_build():
    names = {dist.metadata["Name"].lower() for dist in importlib.metadata.distributions()}
    assert "opencv-python-headless" in names and "opencv-python" not in names, sorted(n for n in names if "opencv" in n)
    assert "imagecorruptions-imaug" in names
    pinned = (REPO / "requirements-nodeps.lock").read_text()
    assert f"imagecorruptions-imaug=={importlib.metadata.version('imagecorruptions-imaug')}" in pinned

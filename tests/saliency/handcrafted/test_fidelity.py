"""Fidelity to the authors' own maps on PASCAL-S dev images (skips without the shared data).

The protocol of ``benchmarks/compare_reference.py``: our map as the CLI writes it (8-bit),
both maps min-max normalised, Pearson correlation and mean absolute difference per image.
``benchmarks/RESULTS.md`` reports, over all dev images: MC correlation 1.000 (MAD .001), DSR
.988 (.016), MR .982 (.019), RBD .953 (.034). The thresholds below sit just outside what these
images measure today (2026-11-23, in brackets), so a change that moves a method away from the
authors' code fails here instead of only in the next benchmark run.
"""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.handcrafted.methods import METHODS
from relicv2.saliency.images import read_gray, read_rgb
from relicv2.saliency.metrics import normalise_prediction

# method: (images, minimum correlation, maximum mean absolute difference, aggregate)
FIDELITY = {
    # pixel for pixel: every image (measured 1.0000 / 0.0000 on each)
    "mc": (("0001", "0002", "0003", "0004", "0005", "0006"), 0.9995, 0.002, "each"),
    # mean over the images (measured .9623 / .0239)
    "rbd": (("0001", "0002", "0003", "0004", "0005", "0006"), 0.955, 0.028, "mean"),
    # mean (measured .9894 / .0109); 0002, where MR's two-stage threshold flips, is left out
    "mr": (("0003", "0004", "0005", "0006", "0007", "0008"), 0.985, 0.014, "mean"),
    # mean (measured .9893 / .0152); the reference's own K-means is unseeded
    "dsr": (("0001", "0002", "0003"), 0.985, 0.018, "mean"),
}


def _compare(method: str, root, stem: str) -> tuple[float, float]:
    ours = normalise_prediction(np.rint(METHODS[method](read_rgb(root / "images" / f"{stem}.jpg")) * 255.0))
    reference = normalise_prediction(read_gray(root / "reference-maps" / method / f"{stem}.png"))
    return float(np.corrcoef(ours.ravel(), reference.ravel())[0, 1]), float(np.abs(ours - reference).mean())


@pytest.mark.parametrize("method", list(FIDELITY))
def test_maps_match_the_authors_reference_maps(method, shared_data):
    stems, min_correlation, max_difference, aggregate = FIDELITY[method]
    figures = [_compare(method, shared_data / "pascal-s-dev", stem) for stem in stems]
    correlations = np.array([c for c, _ in figures])
    differences = np.array([d for _, d in figures])
    if aggregate == "each":
        assert correlations.min() > min_correlation, figures
        assert differences.max() < max_difference, figures
    else:
        assert correlations.mean() > min_correlation, figures
        assert differences.mean() < max_difference, figures

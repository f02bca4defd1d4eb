"""Deterministic seeds for named purposes: one integer per (run seed, purpose, epoch, index, ...).

Every random stream of a run is seeded from the run seed through `derive_seed`, with a `Purpose`
as the second part, so two streams never share a seed by accident and a reader sees which stream
a seed belongs to.
"""

from __future__ import annotations

from enum import IntEnum

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant to spread (seed, purpose, epoch, index) over the seed space


class Purpose(IntEnum):
    """What a derived seed is for (the values are part of reproducibility: never renumber)."""

    SYNTHETIC_CLASS_PATTERN = 1  # a class's smooth pattern in the generated data set
    SYNTHETIC_IMAGE_PATTERN = 2  # an image's own smooth pattern
    SYNTHETIC_EPOCH_ORDER = 3  # the permutation of the generated images in one epoch
    SYNTHETIC_VIEWS = 4  # the random crops, flips and colour changes of one image in one epoch


def derive_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (seed, purpose, epoch, index, ...)."""
    value = 0
    for part in parts:
        value = (value * _MIX + int(part) + 1) % (2**63 - 1)
    return value

"""Deterministic seeds for every random stream of a run, derived from (run seed, purpose, ...): each stream
has a named purpose, so two streams never share a seed by accident. The purposes' values are part of the
results' reproducibility: never renumber them, only add new ones."""

from __future__ import annotations

from enum import IntEnum

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant to spread (seed, purpose, epoch, index) over the seed space


class SeedPurpose(IntEnum):
    """What a derived seed drives (the second part given to :func:`derive_seed`)."""

    SYNTHETIC_CLASS_PATTERN = 1  # the generated data set's per-class pattern
    SYNTHETIC_IMAGE_PATTERN = 2  # the generated data set's per-image pattern
    EPOCH_ORDER = 3  # the sample permutation of an epoch
    VIEW_PARAMETERS = 4  # one image's augmentation parameters in one epoch
    NEGATIVES = 5  # the loss's negative sampling at one step


def derive_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers, usually (seed, SeedPurpose, epoch or step, index, ...)."""
    value = 0
    for part in parts:
        value = (value * _MIX + int(part) + 1) % (2**63 - 1)
    return value

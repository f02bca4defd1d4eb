"""Shared test fixtures. Real images live in ../shared/data beside the repository (absent in a user's clone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.paths import SHARED_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared real-image folder; tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (only present beside the team's checkouts)")
    return SHARED_DATA

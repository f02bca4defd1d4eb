"""Where the tests find the repository and the team's shared real images (absent in a user's clone)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
CONFIGS = REPO / "configs"

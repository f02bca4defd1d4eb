"""The user guide: linked from the README, and its "reproducing the paper" table agrees with the preset."""

from __future__ import annotations

import re

from relicv2.pretrain.config import load_config
from tests.paths import CONFIGS, REPO

GUIDE = REPO / "docs" / "guide.md"


def test_guide_and_config_reference_are_linked():
    readme = (REPO / "README.md").read_text()
    assert "docs/guide.md" in readme and "docs/config.md" in readme
    assert "(config.md)" in GUIDE.read_text()


def test_paper_table_preset_column_matches_the_preset_file():
    import yaml

    config = load_config(CONFIGS / "imagenet-r50-1000ep.yaml")
    section = GUIDE.read_text().split("## Reproducing the paper")[1]
    rows = re.findall(r"^\| [^|]+ \| `([a-z_]+)\.([a-z_]+)` \| [^|]+ \| `([^`]+)` \|", section, re.M)
    assert len(rows) >= 15
    for group, key, written in rows:
        actual = getattr(getattr(config, group), key)
        assert yaml.safe_load(written) == actual, f"{group}.{key}: guide says {written}, preset has {actual}"


def test_guide_covers_the_troubleshooting_topics():
    text = GUIDE.read_text()
    for topic in ("DALI / CUDA mismatch", "Shared memory", "NCCL timeouts", "Resume with another world size",
                  "Corrupt shards"):
        assert f"**{topic}.**" in text
    # Times are marked: measured on the GPU where benchmarks/RESULTS.md has the figure, estimates as such.
    workflow = text.split("## The ImageNet workflow")[1].split("## Troubleshooting")[0]
    assert "(est.)" in workflow and "measured on one H100" in workflow

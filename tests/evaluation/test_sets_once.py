"""An evaluation job resolves its train and val sets once and hands that resolution to everything that reads them."""

from __future__ import annotations

from collections import Counter

import pytest
from click.testing import CliRunner

from relicv2.cli.eval import eval_group
from tests.pretrain.test_shard_sets_once import _LISTED  # its audit hook counts the folders listed


@pytest.mark.parametrize("command", [
    ["knn", "--k", "3", "--crop-size", "16"],
    ["linear", "--config", "fast", "--set", "epochs=1", "--set", "crop_size=16", "--set", "resize_size=16"],
])
def test_eval_lists_each_set_folder_once(shape_shards, tmp_path, command):
    train, val = shape_shards
    _LISTED.append(Counter())
    try:
        result = CliRunner().invoke(eval_group, [*command, "--random-init", "18", "--train", str(train),
                                                 "--val", str(val), "--device", "cpu"])
    finally:
        listed = _LISTED.pop()
    assert result.exit_code == 0, result.output
    # the spec checks, the class check, the progress total and the reader each listed the folders again
    assert (listed[train.resolve()], listed[val.resolve()]) == (1, 1)

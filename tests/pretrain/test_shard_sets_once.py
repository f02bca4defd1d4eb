"""A run resolves each shard set once, before any work, and hands that resolution to the views and the kNN monitor."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

from relicv2.pretrain.run import build_view_source
from relicv2.shards import ShardSet
from tests.pretrain.conftest import quiet_run, tiny_config
from tests.pretrain.test_misconfig import SHARDS, _shard_set
from tests.threads import one_torch_thread

_LISTED: list[Counter] = []  # the folders listed while a test watches (an audit hook cannot be removed)


def _count_listings(event: str, args: tuple) -> None:
    if _LISTED and event in ("os.listdir", "os.scandir") and args and args[0] is not None:
        _LISTED[-1][Path(os.fsdecode(args[0])).resolve()] += 1


sys.addaudithook(_count_listings)


def test_each_shard_set_is_listed_once_per_run_and_the_loader_reads_that_resolution(tmp_path):
    train, bank, queries = (_shard_set(tmp_path / name, masks=False) for name in ("train", "bank", "queries"))
    received = []

    def views(config, ctx, shards):
        source = build_view_source(config, ctx, shards)
        received.append((shards, source.samples.source))
        return source

    _LISTED.append(Counter())
    try:
        with one_torch_thread():  # 2 epochs: the kNN monitor reads its sets twice
            quiet_run(tiny_config(tmp_path / "run", *SHARDS, f"data.train_shards={train}", f"knn.train_shards={bank}",
                                  f"knn.val_shards={queries}", "knn.crop_size=16", "knn.every_epochs=1",
                                  "views.mask_probability=0"), views=views)
    finally:
        listed = _LISTED.pop()
    assert {folder: listed[folder.resolve()] for folder in (train, bank, queries)} == {train: 1, bank: 1, queries: 1}
    [(shards, loaded)] = received
    assert isinstance(shards, ShardSet) and shards.directory == train and shards.samples == 16
    assert loaded is shards  # the loader's samples come from the run's resolution, not one of its own

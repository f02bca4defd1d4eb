"""Option texts and decorators several commands share (one owner each)."""

from __future__ import annotations

from pathlib import Path

import click

SHARDS_HELP = ("a folder (from `relicv2 shards build`, or plain WebDataset tars such as train-0000.tar), "
               "a brace pattern (train-{0000..0099}.tar) or a tar")

index_cache_option = click.option(
    "--index-cache", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Folder for index files derived from shards that have none (plain WebDataset sets; default "
         "$RELICV2_INDEX_CACHE, else the user cache folder).",
)

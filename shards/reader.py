"""Reading shard sets back in Python with webdataset (for later stages and tests)."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

SHARD_PATTERN = re.compile(r"[^.].*-\d{6}\.tar")


def list_shards(directory: Path, prefix: str | None = None) -> list[Path]:
    """The shard tars of a folder (`*-NNNNNN.tar`, optionally of one prefix), sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"shard folder {directory} does not exist; check the path")
    tars = sorted(
        p
        for p in directory.iterdir()
        if SHARD_PATTERN.fullmatch(p.name) and (prefix is None or p.name.startswith(prefix + "-"))
    )
    if not tars:
        what = f"{prefix}-NNNNNN.tar" if prefix else "*-NNNNNN.tar"
        raise FileNotFoundError(f"no shards ({what}) in {directory}; build them with relicv2 shards build")
    return tars


def warn_and_continue(exc: Exception) -> bool:
    """Default handler (webdataset's convention): warn about a corrupt shard or sample, go on."""
    warnings.warn(f"skipped unreadable shard data: {exc!r}", stacklevel=2)
    return True


def decode_sample(raw: dict) -> dict:
    """A webdataset raw sample -> {key, jpg, label, meta, shard, <other extensions>: bytes}."""
    key = raw["__key__"]
    if "jpg" not in raw:
        raise ValueError(f"sample {key!r} in {raw.get('__url__')} has no .jpg member")
    sample = {
        "key": key,
        "shard": raw.get("__url__"),
        "label": int(raw["cls"]) if "cls" in raw else None,
        "meta": json.loads(raw["json"]) if "json" in raw else {},
    }
    for name, value in raw.items():
        if not name.startswith("__") and name not in ("cls", "json"):
            sample[name] = value
    return sample


def iter_samples(
    source: Path | Sequence[Path],
    *,
    handler: Callable[[Exception], bool] = warn_and_continue,
) -> Iterator[dict]:
    """Iterate the samples of a shard folder, a tar, or a list of tars, in shard order.

    Each item: `key`, `jpg` (bytes), `label` (int or None), `meta` (the json dict), `shard` (tar
    path) and every other member by extension, e.g. `"mask.png"`. A corrupt tar or sample is passed
    to `handler` (webdataset convention: return True to continue); the default warns and goes on.
    No node or worker splitting: callers that run on several ranks pass each its own tars.
    """
    if isinstance(source, str | Path):
        source = Path(source)
        tars = list_shards(source) if source.is_dir() else [source]
    else:
        tars = [Path(p) for p in source]
    # Imported here: webdataset imports torch (~1 s), which writing and building shards never need.
    import webdataset as wds

    urls = [str(p) for p in tars]
    for path in tars:
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} does not exist; check the path")
    dataset = wds.WebDataset(
        urls,
        handler=handler,
        shardshuffle=False,
        nodesplitter=None,
        workersplitter=None,
        empty_check=False,
    )
    # Decoded here rather than with dataset.map(), which copies `__key__`/`__url__` back into items.
    for raw in dataset:
        try:
            yield decode_sample(raw)
        except Exception as exc:
            if not handler(exc):
                break

"""The class names of labelled shard sets, and the check that a train and a val set number them alike.

`relicv2 shards build` numbers the sorted class folders of each build 0, 1, ... and records their
names in the set's info.json ("classes"). A val set built from other class folders than its train
set (3 of the 4, or unrelated ones) numbers them differently, and any score against it would be
computed on mismatched labels. Every evaluation (`eval knn`, the kNN monitor, `eval linear`,
`eval finetune`) calls `check_same_classes` before any work, and sizes its head or its votes with
`class_count`, which refuses a label outside the classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from relicv2.shards.outdir import INFO_NAME
from relicv2.shards.shardset import ShardSet, Spec, shard_tars

SHOWN = 8  # class names shown around the first difference


class ClassMismatchError(ValueError):
    """A train and a val set whose class indices mean different classes; names both sets and the fix."""


def class_names(shard_set: ShardSet) -> list[str] | None:
    """The class names a build recorded for a shard set (name i is class i), or None when it has none.

    The names are read from the info.json of the set's folder (for a pattern or a list: of the one
    folder holding all its tars). Sets without them (plain WebDataset sets, sets written by
    `shards.write_shard_set`, flat builds without classes) give None: they cannot be compared.
    """
    tars, folder = shard_tars(shard_set)
    parents = {tar.parent for tar in tars}
    folder = folder or (parents.pop() if len(parents) == 1 else None)
    if folder is None or not (folder / INFO_NAME).is_file():
        return None
    info_path = folder / INFO_NAME
    try:
        info = json.loads(info_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ClassMismatchError(f"{info_path} is not readable JSON ({error}); check the set with "
                                 f"`relicv2 shards verify {folder}` or rebuild it") from None
    classes = info.get("classes") if isinstance(info, dict) else None
    if classes is None:
        return None
    if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
        raise ClassMismatchError(f"{info_path}: 'classes' is not a list of class names; rebuild the set "
                                 "with `relicv2 shards build`")
    return classes or None


def check_same_classes(train_shards: ShardSet, val_shards: ShardSet) -> None:
    """Refuse (ClassMismatchError) a train and a val set whose recorded class names differ.

    Sets without recorded names are not compared (nothing to compare; their `cls` indices are
    taken as they are). Cheap (two small JSON files): every rank of a distributed job may call it.
    """
    train, val = class_names(train_shards), class_names(val_shards)
    if train is None or val is None or train == val:
        return
    first = next((i for i, (a, b) in enumerate(zip(train, val, strict=False)) if a != b), min(len(train), len(val)))
    train_says = repr(train[first]) if first < len(train) else "absent"
    val_says = repr(val[first]) if first < len(val) else "absent"
    raise ClassMismatchError(
        f"train set {train_shards} has {len(train)} classes {_shown(train, first)}, val set {val_shards} "
        f"{len(val)} {_shown(val, first)}: class {first} is {train_says} in train, {val_says} in val, so class "
        "indices differ; build both from folders with the same class sub-folders"
    )


def class_count(*labelled: tuple[Spec, Iterable[int]]) -> int:
    """The number of classes of labelled sets, each given with its labels (a head's outputs, the width of
    the kNN votes): what their info.json declares, else the classes their labels hold. ValueError naming the
    set and the fix when a label lies outside (one stray label would make a head of a million classes)."""
    present = [(source, np.unique(np.asarray(labels, dtype=np.int64))) for source, labels in labelled]
    declared = next((names for source, _ in labelled if (names := class_names(source)) is not None), None)
    count = len(declared) if declared is not None else len(np.unique(np.concatenate([c for _, c in present])))
    for source, classes in present:
        if len(classes) and classes[-1] >= count:
            held = (f"its {INFO_NAME} declares {count} classes" if declared is not None
                    else f"the sets hold {count} distinct classes, so indices run from 0 to {count - 1}")
            raise ValueError(f"{source}: a sample has class index {classes[-1]}, but {held}; fix the set's `cls` "
                             "members or rebuild it with `relicv2 shards build` from class folders")
    return count


def _shown(names: list[str], first: int) -> str:
    """All names when few, else a window around index `first`: "[..., b, c, d, ...]"."""
    start = max(0, min(first - 2, len(names) - SHOWN))
    window = names[start:start + SHOWN]
    window = (["..."] if start else []) + window + (["..."] if start + SHOWN < len(names) else [])
    return "[" + ", ".join(window) + "]"

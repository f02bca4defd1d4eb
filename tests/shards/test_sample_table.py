"""SampleTable: the compact form of a set's samples gives back exactly the SampleRefs put in."""

import pickle
from pathlib import Path

import numpy as np
import pytest

from relicv2.shards.reader import SampleRef
from relicv2.shards.sample import MASK_MEMBER
from relicv2.shards.sample_table import CHUNK, SampleTable


def make_refs(count: int, tars: int = 3) -> list[SampleRef]:
    """Samples spread over `tars` tars, with and without masks and labels, some under folders."""
    refs = []
    for i in range(count):
        key = f"n0144_{i:06d}" if i % 7 else f"é{i}"
        prefix = "train/cls/" if i % 5 == 0 else ""
        members = {"jpg": (1024 * i + 512, 900 + i, f"{prefix}{key}.jpg")}
        if i % 3:
            members[MASK_MEMBER] = (1024 * i + 1536, 40 + i % 11, f"{prefix}{key}.{MASK_MEMBER}")
        if i % 4:
            members["cls"] = (1024 * i + 2048, 1 + i % 3, f"{prefix}{key}.cls")
        refs.append(SampleRef(key, Path(f"/shards/train-{i % tars:06d}.tar"), members))
    return refs


def test_round_trip_gives_the_same_samples():
    refs = make_refs(CHUNK + 37)  # more than one chunk of iteration
    table = SampleTable.from_refs(refs)
    assert len(table) == len(refs)
    assert list(table) == refs
    assert table[0] == refs[0] and table[-1] == refs[-1] and table[1234] == refs[1234]
    assert list(table.keys()) == [r.key for r in refs]
    with pytest.raises(IndexError):
        table[len(refs)]


def test_slices_and_selections_keep_order():
    refs = make_refs(50)
    table = SampleTable.from_refs(refs)
    assert list(table[10:20]) == refs[10:20]
    assert list(table[::-3]) == refs[::-3]
    picks = [49, 3, 3, 17, 0]
    chosen = table.select(picks)
    assert isinstance(chosen, SampleTable) and list(chosen) == [refs[i] for i in picks]
    assert list(chosen.select([4, 0])) == [refs[0], refs[49]]  # a selection of a selection
    empty = table.select([])
    assert len(empty) == 0 and list(empty) == [] and not empty


def test_groups_by_tar_and_member_flags():
    refs = make_refs(40, tars=4)
    table = SampleTable.from_refs(refs).select(list(range(39, -1, -1)))  # tars no longer contiguous
    groups = table.by_tar()
    assert sorted(groups) == sorted({r.tar for r in refs})
    for tar, group in groups.items():
        assert list(group) == [r for r in reversed(refs) if r.tar == tar]
    assert table.with_member(MASK_MEMBER).tolist() == [MASK_MEMBER in r.members for r in reversed(refs)]
    assert not table.with_member("json").any()


def test_survives_pickling_for_spawned_workers():
    refs = make_refs(30)
    table = pickle.loads(pickle.dumps(SampleTable.from_refs(refs)))
    assert list(table) == refs


def test_holds_a_fraction_of_the_objects_memory():
    """ImageNet-like names: the columns must stay near 40 B per member plus the name."""
    refs = make_refs(2000)
    table = SampleTable.from_refs(refs)
    members = sum(len(r.members) for r in refs)
    names = sum(len(m[2].encode()) for r in refs for m in r.members.values())
    assert table.nbytes() <= 12 * len(refs) + 26 * members + names + 8
    assert isinstance(table._offsets, np.ndarray) and table._offsets.dtype == np.int64  # offsets past 4 GiB

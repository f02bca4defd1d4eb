"""`relicv2 shards verify DIR`: check every shard of a set against its manifest.

Checks: every manifest shard exists and no unlisted shard does; each tar reads completely; each
sample's members are adjacent, its key, position, label, size and content hash match the manifest;
its `.jpg` decodes fully with the recorded width and height; each `.idx` exists and equals the index
computed from the tar; keys are unique across the set; info.json agrees on the sample count.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import multiprocessing
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shards.images import decode
from shards.index import index_path, index_text, split_member_name
from shards.manifest import read_manifest
from shards.reader import SHARD_PATTERN
from shards.sample import content_hash


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of a verification: what was checked and every problem found, one sentence each."""

    shards: int
    samples: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_tar_samples(tar: Path) -> tuple[list[tuple[str, list[tuple[str, bytes]]]], list[str]]:
    """The samples of a tar in order as (key, [(ext, bytes)]), and problems reading it."""
    samples: list[tuple[str, list[tuple[str, bytes]]]] = []
    problems: list[str] = []
    seen: set[str] = set()
    try:
        with tarfile.open(tar, "r:") as archive:
            for member in archive:
                if not member.isreg():
                    problems.append(f"{tar.name}: member {member.name!r} is not a regular file")
                    continue
                key, ext = split_member_name(member.name)
                data = archive.extractfile(member).read()
                if samples and samples[-1][0] == key:
                    samples[-1][1].append((ext, data))
                    continue
                if key in seen:
                    problems.append(f"{tar.name}: members of sample {key!r} are not adjacent")
                seen.add(key)
                samples.append((key, [(ext, data)]))
    except (tarfile.TarError, OSError, EOFError) as exc:
        problems.append(f"{tar.name}: tar cannot be read to the end ({exc}); rebuild this shard")
    return samples, problems


def sample_problems(tar: Path, key: str, members: list[tuple[str, bytes]], row: dict, decode_images: bool) -> list[str]:
    """Problems of one sample against its manifest row."""
    where = f"{tar.name}: sample {key!r}"
    problems = []
    if key != row["key"]:
        return [f"{where} at position {row['position']}: manifest expects key {row['key']!r}"]
    if [e for e, _ in members] != sorted(e for e, _ in members):
        problems.append(f"{where}: members are not in sorted order")
    if content_hash(members) != row["content_hash"]:
        problems.append(f"{where}: content hash differs from the manifest (data changed or corrupted)")
    if sum(len(d) for _, d in members) != row["byte_size"]:
        problems.append(f"{where}: byte size differs from the manifest")
    found = dict(members)
    label = int(found["cls"]) if "cls" in found and found["cls"].strip().isdigit() else None
    if label != row["label"]:
        problems.append(f"{where}: class {label} differs from the manifest's {row['label']}")
    if "jpg" not in found:
        return problems + [f"{where}: has no .jpg member"]
    if decode_images:
        try:
            image = decode(found["jpg"])
            if image.format not in ("JPEG", "MPO") or image.mode != "RGB":
                problems.append(f"{where}: .jpg is {image.format} {image.mode}, not an RGB JPEG")
            if row["width"] is not None and image.size != (row["width"], row["height"]):
                problems.append(f"{where}: image is {image.size[0]}x{image.size[1]}, manifest says {row['width']}x{row['height']}")
        except Exception as exc:  # any decoder failure is a reported problem
            problems.append(f"{where}: .jpg does not decode ({type(exc).__name__}: {exc})")
    try:
        json.loads(found.get("json", b"{}"))
    except ValueError:
        problems.append(f"{where}: .json member is not valid JSON")
    return problems


def verify_shard(tar: Path, rows: list[dict], decode_images: bool = True) -> list[str]:
    """Problems of one shard (its tar and its index) against its manifest rows (sorted by position)."""
    if not tar.is_file():
        return [f"{tar.name}: listed in the manifest but missing; rebuild the shard set"]
    problems = []
    idx = index_path(tar)
    if not idx.is_file():
        problems.append(f"{idx.name}: index file missing; recreate it with shards.write_index or rebuild")
    else:
        try:
            if idx.read_text(encoding="utf-8") != index_text(tar):
                problems.append(f"{idx.name}: index does not match {tar.name}; recreate it with shards.write_index")
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{idx.name}: cannot be checked ({exc})")
    samples, read_problems = read_tar_samples(tar)
    problems += read_problems
    if len(samples) != len(rows):
        problems.append(f"{tar.name}: holds {len(samples)} samples, the manifest lists {len(rows)}")
    for (key, members), row in zip(samples, rows, strict=False):
        problems += sample_problems(tar, key, members, row, decode_images)
    return problems


def verify_shard_set(directory: Path, *, workers: int = 1, decode_images: bool = True) -> VerifyReport:
    """Verify a shard set folder; every problem is reported, none raised (except a missing manifest)."""
    directory = Path(directory)
    manifest = read_manifest(directory).to_pylist()
    by_shard: dict[str, list[dict]] = {}
    for row in manifest:
        by_shard.setdefault(row["shard"], []).append(row)
    problems = []
    for name, rows in by_shard.items():
        positions = sorted(r["position"] for r in rows)
        if positions != list(range(len(rows))):
            problems.append(f"manifest: positions of {name} are not 0..{len(rows) - 1}")
        rows.sort(key=lambda r: r["position"])
    duplicates = [k for k, n in Counter(r["key"] for r in manifest).items() if n > 1]
    if duplicates:
        problems.append(f"manifest: {len(duplicates)} duplicate key(s), e.g. {duplicates[0]!r}")
    on_disk = {p.name for p in directory.iterdir() if SHARD_PATTERN.fullmatch(p.name)}
    for name in sorted(on_disk - set(by_shard)):
        problems.append(f"{name}: shard on disk but not in the manifest")
    tars = [directory / n for n in sorted(by_shard)]
    check = functools.partial(verify_shard, decode_images=decode_images)
    if workers <= 1:
        per_shard = [check(t, by_shard[t.name]) for t in tars]
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
            per_shard = list(pool.map(check, tars, [by_shard[t.name] for t in tars]))
    problems += [p for shard_problems in per_shard for p in shard_problems]
    info = directory / "info.json"
    if info.is_file():
        recorded = json.loads(info.read_text()).get("samples")
        if recorded != len(manifest):
            problems.append(f"info.json: records {recorded} samples, the manifest lists {len(manifest)}")
    else:
        problems.append("info.json: missing")
    return VerifyReport(len(tars), len(manifest), problems)

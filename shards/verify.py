"""`relicv2 shards verify DIR`: check every shard of a set, with or without a manifest.

With a manifest (sets from `shards build`): every manifest shard exists and no unlisted shard
does; each tar reads completely; each sample's members are adjacent, its key, position, label,
size and content hash match the manifest; its `.jpg` decodes fully with the recorded width and
height (as displayed: EXIF orientation applied), and its `mask.png`, when present, decodes at that
size or a scaled copy of it; each `.idx` exists and equals the index computed from the tar; keys
are unique across the set; info.json agrees on the sample count. Without one (plain WebDataset
shards): every tar reads completely, every sample has a decodable image (jpg/jpeg/png/webp) and a
fitting mask when it has one (a `cls` holding a class name is not damage), and the index (beside
the tar or derived into the cache) agrees with the tar. Every problem is one line.
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from relicv2.shards.driver import REHASH_OPTION
from relicv2.shards.images import JPEG_FORMATS, ImageLoadError, decode, displayed_size
from relicv2.shards.index import INDEX_FIX, index_path, index_text
from relicv2.shards.manifest import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    REJECTED_NAME,
    is_plain_tar_name,
    read_manifest,
)
from relicv2.shards.merge import plan_file
from relicv2.shards.reader import ReadReport, Sample, read_samples
from relicv2.shards.sample import MASK_MEMBER, content_hash
from relicv2.shards.shardset import (
    SHARD_PATTERN,
    default_index_cache,
    in_workers,
    list_shard_files,
    tar_index,
)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of a verification: what was checked and every problem found, one sentence each."""

    shards: int
    samples: int
    problems: list[str] = field(default_factory=list)
    repair: str | None = None  # how to rebuild damaged shards (sets from `relicv2 shards build`), else None

    @property
    def ok(self) -> bool:
        return not self.problems


def read_problems(tar: Path, report: ReadReport) -> list[str]:
    """One line per loss the reader recorded while reading `tar` (every member it refused, by reason)."""
    problems = [f"{tar.name}: tar cannot be read to the end: {reason}; rebuild this shard" for _, reason in report.lost_shards]
    problems += [f"{tar.name}: {name!r} left out ({code}): {detail}"
                 for (_, name, detail), code in zip(report.rejected, report.codes, strict=True)]
    return problems


def mask_problem(where: str, mask: bytes, size: tuple[int, int]) -> str | None:
    """Why a mask member does not fit its image of displayed `size` (width, height), or None: a mask is at
    the displayed size or a scaled copy of it (same aspect up to rounding); one with the stored size of an
    EXIF-rotated image was made for the wrong orientation."""
    try:
        mw, mh = decode(mask).size
    except ImageLoadError as exc:
        return f"{where}: {MASK_MEMBER} does not decode ({exc.detail})"
    width, height = size
    if abs(mw * height - mh * width) > width + height:
        return (f"{where}: {MASK_MEMBER} is {mw}x{mh}, not the displayed image's {width}x{height} or a scaled "
                "copy (made for another image or the stored rather than displayed orientation); rebuild the masks "
                "with relicv2 saliency build-masks")
    return None


# The format an image member's name announces, for sets with a manifest: `shards build` writes RGB
# JPEGs as `jpg`; `saliency build-masks` keeps a png or webp input image under its own name.
MEMBER_FORMATS = {"jpg": JPEG_FORMATS, "jpeg": JPEG_FORMATS, "png": ("PNG",), "webp": ("WEBP",)}
JPEG_MODES = ("RGB", "L")  # JPEG colour modes every decoder here (PIL, DALI) returns as RGB


def decode_problems(where: str, data: bytes, row: dict | None, mask: bytes | None = None,
                    member: str = "jpg") -> list[str]:
    """Why an image member does not decode (or does not match its name, its manifest row or its mask)."""
    try:
        image = decode(data)
    except ImageLoadError as exc:
        return [f"{where}: image does not decode ({exc.detail})"]
    size = displayed_size(image)  # what the json, the manifest and every decoder (DALI included) report
    problems = []
    if mask is not None and (problem := mask_problem(where, mask, size)):
        problems.append(problem)
    if row is None:
        return problems
    # Greyscale JPEGs (from foreign sets copied by build-masks) decode to RGB everywhere; CMYK is refused.
    if member == "jpg" and (image.format not in JPEG_FORMATS or image.mode not in JPEG_MODES):
        problems.append(f"{where}: .jpg is {image.format} {image.mode}, not an RGB or greyscale JPEG")
    elif image.format not in MEMBER_FORMATS.get(member, JPEG_FORMATS):
        problems.append(f"{where}: .{member} is {image.format}, not what its name says")
    elif row["width"] is not None and size != (row["width"], row["height"]):
        problems.append(f"{where}: image is {size[0]}x{size[1]} as displayed, manifest says "
                        f"{row['width']}x{row['height']}")
    return problems


def sample_problems(sample: Sample, row: dict, decode_images: bool) -> list[str]:
    """Problems of one sample against its manifest row."""
    tar, key, members = sample.tar, sample.key, list(sample.members.items())
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
    if sample.label != row["label"]:
        problems.append(f"{where}: class {sample.label} differs from the manifest's {row['label']}")
    if decode_images:  # the reader refuses a sample without an image (no_image)
        problems += decode_problems(where, sample.members[sample.image_ext], row, sample.members.get(MASK_MEMBER),
                                    sample.image_ext)
    return problems


def index_problems(tar: Path, idx: Path) -> list[str]:
    """Whether the index of `tar` exists and equals the one computed from the tar."""
    if not idx.is_file():
        return [f"{idx.name}: index file missing; rerun the job that made the set, which writes it again"]
    try:
        if idx.read_text(encoding="utf-8") != index_text(tar):
            return [f"{idx.name}: index does not match {tar.name}; {INDEX_FIX}"]
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        return [f"{idx.name}: cannot be checked ({exc})"]
    return []


def verify_shard(tar: Path, table: pa.Table | None, index_cache: Path, decode_images: bool = True
                 ) -> tuple[int, list[str], list[str]]:
    """(samples, problems, keys) of one shard: it reads completely, its index agrees with it, its images
    decode, and its samples match its manifest rows (`table`, sorted by position). Without a manifest (`table`
    None) the index is the one beside the tar or, when it has none, the one derived into `index_cache`, and
    `keys` are the samples' keys, for `repeated_keys` (with one, the manifest's keys are checked instead)."""
    if table is not None and not tar.is_file():
        return 0, [f"{tar.name}: listed in the manifest but missing; rebuild the shard set"], []
    rows = None if table is None else table.to_pylist()  # one shard's rows as dicts: a tar's worth, never the set's
    try:
        problems = index_problems(tar, index_path(tar) if rows is not None else tar_index(tar, index_cache))
    except (ValueError, OSError) as exc:
        problems = [f"{tar.name}: no index can be derived ({exc})"]
    report, keys = ReadReport(), []
    for sample in read_samples(tar, report):  # the tar's own headers, not its index: that is checked above
        if rows is None:
            keys.append(sample.key)
        if rows is None and decode_images:
            problems += decode_problems(f"{tar.name}: sample {sample.key!r}", sample.members[sample.image_ext], None,
                                        sample.members.get(MASK_MEMBER))
        elif rows is not None and sample.position < len(rows):
            problems += sample_problems(sample, rows[sample.position], decode_images)
    problems += read_problems(tar, report)
    if rows is not None and report.listed != len(rows):
        problems.append(f"{tar.name}: holds {report.listed} samples, the manifest lists {len(rows)}")
    return report.samples, problems, keys


def repeated_keys(keys: dict[str, list[str]]) -> list[str]:
    """One line when a key is in more than one tar (`keys`: tar name -> its samples' keys) of a set without a
    manifest (a manifest's repeated keys are `shard_tables`' to report): a key list or an evaluation's cache
    names a sample by its key alone."""
    first: dict[str, str] = {}
    repeated: dict[str, tuple[str, str]] = {}
    for tar, names in keys.items():
        for key in names:
            if first.setdefault(key, tar) != tar:
                repeated.setdefault(key, (first[key], tar))
    if not repeated:
        return []
    key, (one, other) = next(iter(repeated.items()))
    return [f"{len(repeated)} key(s) are in more than one tar, e.g. {key!r} in {one} and {other}: a sample is named "
            "by its key (key lists, evaluation caches), so give each sample its own key"]


VERIFIED_COLUMNS = ("key", "shard", "position", "label", "width", "height", "byte_size", "content_hash")


def manifest_problems(directory: Path) -> tuple[pa.Table | None, list[str]]:
    """The manifest's VERIFIED_COLUMNS, or None with the reason when it cannot be used (one line each)."""
    try:
        table = read_manifest(directory)
    except (OSError, pa.ArrowException) as exc:
        return None, [f"{MANIFEST_NAME}: cannot be read ({exc}); rebuild the shard set or remove the file"]
    types = dict(zip(table.column_names, table.schema.types, strict=True))
    wrong = [f"{f.name} ({types.get(f.name, 'missing')})"
             for f in MANIFEST_SCHEMA if types.get(f.name) != f.type]
    if wrong:
        return None, [f"{MANIFEST_NAME}: not a relicv2 manifest, columns {', '.join(wrong)} differ from the schema; rebuild"]
    if missing := [name for name in ("key", "shard", "position") if table.column(name).null_count]:
        return None, [f"{MANIFEST_NAME}: column(s) {', '.join(missing)} have empty values; rebuild the shard set"]
    # Only the columns a sample is checked against, as columns: one dict a row held 1.5 GB at 1.28 M rows.
    return table.select(VERIFIED_COLUMNS), []


def shard_tables(manifest: pa.Table) -> tuple[dict[str, pa.Table], list[str]]:
    """Each shard's manifest rows as a table sorted by position (shards in the manifest's order), and the
    problems of the positions and keys. Columnar throughout: each shard's table is its own copy, so a
    worker is sent its shard's rows, not the set's buffers."""
    shards = pc.dictionary_encode(manifest.column("shard").combine_chunks())
    codes = shards.indices.to_numpy(zero_copy_only=False)
    positions = manifest.column("position").to_numpy()
    order = np.lexsort((positions, codes))  # by shard, then position
    counts = np.bincount(codes, minlength=len(shards.dictionary))
    starts = np.cumsum(counts) - counts
    # Sorted, a shard's positions are 0..n-1 exactly when each equals its rank within the shard.
    misplaced = positions[order] != np.arange(len(order)) - np.repeat(starts, counts)
    wrong = set(np.unique(codes[order][misplaced]).tolist())
    problems, tables = [], {}
    for code, name in enumerate(shards.dictionary.to_pylist()):  # the order of first appearance
        if code in wrong:
            problems.append(f"manifest: positions of {name} are not 0..{counts[code] - 1}")
        tables[name] = manifest.take(order[starts[code]:starts[code] + counts[code]])
    keys = pc.value_counts(manifest.column("key"))
    duplicates = keys.filter(pc.greater(keys.field("counts"), 1))
    if len(duplicates):
        problems.append(f"manifest: {len(duplicates)} duplicate key(s), e.g. {duplicates[0]['values'].as_py()!r}")
    return tables, problems


def verify_shard_set(directory: Path, *, workers: int = 1, decode_images: bool = True,
                     index_cache: Path | None = None, progress: bool = False) -> VerifyReport:
    """Verify a shard set folder; every problem is reported as one line, none raised (FileNotFoundError
    only when the folder holds neither a manifest nor any shard)."""
    directory = Path(directory)
    manifest, problems = manifest_problems(directory) if (directory / MANIFEST_NAME).is_file() else (None, [])
    if manifest is None:
        tars = list_shard_files(directory)
        if not tars:
            raise FileNotFoundError(f"no manifest and no shards (*-NNNNNN.tar) in {directory}; nothing to verify")
        tables = [None] * len(tars)
    else:
        by_shard, order_problems = shard_tables(manifest)
        problems += order_problems
        for name in [n for n in by_shard if not is_plain_tar_name(n) or not SHARD_PATTERN.fullmatch(n)]:
            problems.append(f"manifest: shard name {name!r} is not a shard file name in this folder; rebuild")
            del by_shard[name]
        for name in sorted({p.name for p in list_shard_files(directory)} - set(by_shard)):
            problems.append(f"{name}: shard on disk but not in the manifest")
        tars = [directory / n for n in sorted(by_shard)]
        tables = [by_shard[t.name] for t in tars]
    check = functools.partial(verify_shard, index_cache=default_index_cache(index_cache), decode_images=decode_images)
    results = in_workers(check, tars, tables, workers=workers, desc="shards verify", enabled=progress)
    problems += [p for _, shard_problems, _ in results for p in shard_problems]
    if manifest is None:
        problems += repeated_keys({tar.name: keys for tar, (_, _, keys) in zip(tars, results, strict=True)})
        samples = sum(n for n, _, _ in results)
        if samples == 0:
            problems.append(f"{directory}: its {len(tars)} shard(s) hold no samples; the set is empty")
        return VerifyReport(len(tars), samples, problems)
    info, repair = info_problems(directory, len(manifest))
    problems += info
    if not len(manifest):  # a build whose every input was rejected still writes a (0-row) manifest
        rejected = directory / REJECTED_NAME
        why = f"; every input was rejected, each with its reason in {rejected}" if rejected.is_file() else ""
        problems.append(f"{MANIFEST_NAME}: lists no samples, the set is empty{why}")
        return VerifyReport(len(tars), 0, problems)  # no repair: rerunning the build would reject them again
    return VerifyReport(len(tars), len(manifest), problems, repair)


def repair_command(directory: Path, info: dict) -> str | None:
    """How to rebuild the damaged shards of a set made by `relicv2 shards build`, in `directory` (the folder
    verified, which may be a copy of the one built), or None for sets made otherwise. The command is the
    build's, from its `info`.json, with `--rehash-shards`: a plain rerun would keep a tar whose bytes rotted
    but kept their size and time."""
    if "plan_digest" not in info:
        return None  # not from shards build (e.g. saliency build-masks, write_shard_set)
    command = info.get("command") or "relicv2 shards build INPUT OUT [the options of the first run]"
    if isinstance(info.get("out"), str):  # the folder as the build was told it: this one now
        out = info["out"]
        command = shlex.join(str(directory) if token == out else f"--out={directory}" if token == f"--out={out}"
                             else token for token in shlex.split(command))
    if not plan_file(directory).is_file():  # without its plan the build no longer knows the set as its own
        return f"rebuild the set, replacing it: {command} --overwrite"
    if REHASH_OPTION not in command.split():
        command += f" {REHASH_OPTION}"
    return f"rerun the build that made this set, which re-hashes its shards and rebuilds damaged ones: {command}"


def info_problems(directory: Path, samples: int) -> tuple[list[str], str | None]:
    """The problems of info.json (it must exist, be a JSON object, and record the manifest's sample
    count), and the set's `repair_command`."""
    info = directory / "info.json"
    if not info.is_file():
        return ["info.json: missing"], None
    try:
        recorded = json.loads(info.read_text())
    except (OSError, ValueError) as exc:
        return [f"info.json: not valid JSON ({exc}); rerun relicv2 shards merge or rebuild"], None
    if not isinstance(recorded, dict):
        return ["info.json: not a JSON object; rerun relicv2 shards merge or rebuild"], None
    problems = []
    if recorded.get("samples") != samples:
        problems.append(f"info.json: records {recorded.get('samples')} samples, the manifest lists {samples}")
    return problems, repair_command(directory, recorded)


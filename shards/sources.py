"""Finding the input images of a build: class-folder tree, flat folder, or CSV/parquet file list.

Cheap checks happen here (no image is opened): unsupported extensions, empty files, missing or
unreadable entries, duplicate list entries, files outside class folders. Keys are assigned here.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm", ".pbm"}
)
LIST_SUFFIXES = (".csv", ".parquet")
MAX_STEM = 64  # leaves room for "_" + 8 hex digits within the 80-character key limit
LAYOUTS = ("auto", "classes", "flat")
SAFE_STEM = re.compile(r"[A-Za-z0-9_-]{1,64}")


class InputError(ValueError):
    """A job-level problem with the input (missing path, unreadable list, no images at all)."""


@dataclass(frozen=True)
class SourceImage:
    """One input file planned for writing."""

    source: str  # as recorded in json/manifest: relative to the input folder, or as listed
    path: str  # where to read it
    label: int | None
    class_name: str | None
    size: int  # bytes on disk, for planning shard sizes
    key: str = ""
    mtime_ns: int = 0  # modification time when listed: a rerun tells an edited file by it (shards.job)


@dataclass(frozen=True)
class Listing:
    """What the input holds: usable images (sorted by source), rejections, class names."""

    images: list[SourceImage]
    rejected: list[dict]
    classes: list[str]
    layout: str


def normalise_stem(stem: str) -> str:
    """A file stem -> key stem: accents folded to ASCII, every other character outside
    [A-Za-z0-9_-] (dots, spaces, non-Latin letters) replaced by "_"; at most 64 characters."""
    if SAFE_STEM.fullmatch(stem):
        return stem  # the common case, e.g. ImageNet's n01440764_10026
    folded = (unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode("ascii") for ch in stem)
    return "".join(re.sub(r"[^A-Za-z0-9_-]", "_", ch) or "_" for ch in folded)[:MAX_STEM] or "_"


def stem_of(source: str) -> str:
    """The file stem of a source path (string operations: this runs once per input)."""
    name = source.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return name[:dot] if dot > 0 else name


def suffix_of(path: str) -> str:
    """`os.path.splitext(path)[1]` in string operations (this runs once per input: splitext cost a
    third of checking ImageNet's 1.28 M files)."""
    name = path.rsplit("/", 1)[-1].lstrip(".")  # splitext ignores a name's leading dots
    dot = name.rfind(".")
    return name[dot:] if dot > 0 else ""


def assign_keys(images: list[SourceImage]) -> list[SourceImage]:
    """Give every image a unique key: its normalised stem, plus a hash of its source when stems collide
    (for every member of a colliding group, so a key never depends on listing order)."""
    stems = [normalise_stem(stem_of(im.source)) for im in images]
    counts = Counter(stems)
    # The hash: 8 hex digits identifying the source path, stable across runs and machines.
    keys = [s if counts[s] == 1 else f"{s}_{hashlib.sha1(im.source.encode()).hexdigest()[:8]}"
            for im, s in zip(images, stems, strict=True)]
    # Constructed, not dataclasses.replace: that costs 40 us an image, ~50 s of CPU at ImageNet's size.
    return [SourceImage(im.source, im.path, im.label, im.class_name, im.size, key, im.mtime_ns)
            for im, key in zip(images, keys, strict=True)]


def reject(source: str, reason: str, detail: str) -> dict:
    return {"source": source, "reason": reason, "detail": detail}


def check_file(source: str, path: str, label: int | None, class_name: str | None) -> SourceImage | dict:
    """Cheap checks of one candidate file: extension, existence, size."""
    suffix = suffix_of(path)
    if suffix.lower() not in IMAGE_EXTENSIONS:
        return reject(source, "unsupported_extension", f"extension {suffix or '(none)'!r} is not an image type")
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return reject(source, "missing", "file does not exist (or is a broken link)")
    except OSError as exc:
        return reject(source, "unreadable", f"file cannot be read ({exc.strerror or exc})")
    if stat.st_size == 0:
        return reject(source, "empty_file", "file is empty (0 bytes)")
    return SourceImage(source, path, label, class_name, stat.st_size, "", stat.st_mtime_ns)


def walk_files(root: Path, exclude: Path | None = None) -> tuple[list[tuple[str, str]], list[dict]]:
    """(relative posix path, full path) of every non-directory entry under root, broken links included
    (they are reported), and rejections for folders left out. Hidden folders and `exclude` (the build's
    output folder) are skipped. Directory links are followed, but no folder is walked twice (a link loop,
    or two links to one folder, would repeat its images and never end): the second visit is reported."""
    found: list[tuple[str, str]] = []
    rejected: list[dict] = []
    excluded = _identity(exclude) if exclude is not None else None
    seen = {_identity(root)}

    def unlisted(exc: OSError) -> None:
        rejected.append(reject(os.path.relpath(exc.filename, root), "unreadable",
                               f"folder cannot be listed ({exc.strerror or exc})"))

    for folder, subfolders, files in os.walk(root, onerror=unlisted, followlinks=True):
        prefix = "" if folder == str(root) else os.path.relpath(folder, root) + "/"
        found += [(prefix + name, os.path.join(folder, name)) for name in sorted(files)]
        kept = []
        for name in sorted(subfolders):
            identity = None if name.startswith(".") else _identity(Path(folder, name))
            if identity is None or identity == excluded:
                continue  # hidden, or the output folder inside the input: never an input
            if identity in seen:
                rejected.append(reject(prefix + name, "folder_visited_twice",
                                       "folder (or a link to it) was already walked: a link loop or a second link; left out"))
                continue
            seen.add(identity)
            kept.append(name)
        subfolders[:] = kept  # os.walk descends into these only, in this order
    return found, rejected


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a folder, following links; None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def list_folder(root: Path, layout: str, exclude: Path | None = None) -> Listing:
    """A class-folder tree (sub-folders = classes) or a flat folder (unlabeled, searched recursively)."""
    excluded = _identity(exclude) if exclude is not None else None
    subdirs = sorted(
        p.name for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (excluded is None or _identity(p) != excluded)
    )
    if layout == "classes" and not subdirs:
        raise InputError(f"{root} has no class sub-folders; use --layout flat for an unlabeled folder")
    by_class = layout == "classes" or (layout == "auto" and bool(subdirs))
    classes = subdirs if by_class else []
    index = {name: i for i, name in enumerate(classes)}
    images = []
    files, rejected = walk_files(root, exclude)
    for source, path in files:
        name = source.split("/", 1)[0] if by_class and "/" in source else None
        if by_class and name is None:
            rejected.append(reject(source, "outside_class_folder", "file lies beside the class folders, not in one"))
            continue
        result = check_file(source, path, index[name] if by_class else None, name)
        (images if isinstance(result, SourceImage) else rejected).append(result)
    return Listing(images, rejected, classes, "classes" if by_class else "flat")


def list_table(list_file: Path) -> Listing:
    """A CSV or parquet file list: column `path` (relative to the list's folder or absolute),
    optional integer `label` and/or `class` (names, mapped to indices in sorted order)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(list_file) if list_file.suffix == ".parquet" else pacsv.read_csv(list_file)
    except Exception as exc:
        raise InputError(f"cannot read the file list {list_file} ({exc}); give a CSV or parquet file") from exc
    if "path" not in table.column_names:
        raise InputError(f"file list {list_file} has no 'path' column (columns: {', '.join(table.column_names)})")
    rows = table.to_pylist()
    names = [r.get("class") for r in rows]
    labels = [r.get("label") for r in rows]
    if any(isinstance(v, str) for v in labels):  # a textual label column holds class names
        names, labels = labels, [None] * len(rows)
    classes = sorted({str(n) for n in names if n is not None and n != ""})
    index = {name: i for i, name in enumerate(classes)}
    images, rejected, seen = [], [], set()
    for row, name, label in zip(rows, names, labels, strict=True):
        source = str(row["path"] or "")
        if not source:
            rejected.append(reject(source, "missing", "empty path in the file list"))
            continue
        if source in seen:
            rejected.append(reject(source, "duplicate_entry", "path listed more than once; kept the first"))
            continue
        seen.add(source)
        name = None if name in (None, "") else str(name)
        if isinstance(label, float) and label != label:  # NaN: parquet's missing label
            label = None
        if label is None and name is not None:
            label = index[name]
        path = source if os.path.isabs(source) else os.path.join(list_file.parent, source)
        result = check_file(source, path, None if label is None else int(label), name)
        (images if isinstance(result, SourceImage) else rejected).append(result)
    return Listing(images, rejected, classes, "list")


def list_inputs(source: Path, layout: str = "auto", exclude: Path | None = None) -> Listing:
    """Find the inputs of a build, leaving out `exclude` (its output folder); keys assigned, images sorted
    by source. Raises InputError on job-level problems."""
    source = Path(source)
    if layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if source.is_dir():
        listing = list_folder(source, layout, exclude)
    elif source.is_file() and source.suffix.lower() in LIST_SUFFIXES:
        listing = list_table(source)
    elif source.exists():
        raise InputError(f"{source} is neither a folder nor a .csv/.parquet file list")
    else:
        raise InputError(f"input {source} does not exist; give an image folder or a .csv/.parquet file list")
    if not listing.images and not listing.rejected:
        raise InputError(f"no files found in {source}; nothing to build")
    images, rejected, keys = [], list(listing.rejected), set()
    for im in assign_keys(sorted(listing.images, key=lambda im: im.source)):
        if im.key in keys:  # only if a file is literally named like another's hashed key
            rejected.append(reject(im.source, "duplicate_key", f"key {im.key!r} is already taken"))
            continue
        keys.add(im.key)
        images.append(im)
    rejected.sort(key=lambda r: (r["source"], r["reason"]))
    return replace(listing, images=images, rejected=rejected)

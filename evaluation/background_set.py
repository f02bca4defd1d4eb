"""The backgrounds test's variant set: every usable image of a labelled val set as each variant of
`evaluation.backgrounds`, written through the shard-job engine as one shard set of `{variant}-NNNNNN.tar`
(a unit: one variant of a chunk of images), so that a rerun resumes unit by unit and the composites can be
looked at. The masks come from the val set's own `mask.png` members (`saliency build-masks` output), from a
shard set of masks keyed like the images, or from a folder of ground-truth `KEY.png` files.

An image is left out, and counted in the set's info.json and listed in its rejected.parquet, when it has no
mask, its mask is not its image's shape or cannot be read, or `backgrounds.cutout` refuses it.
"""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode

from relicv2.evaluation.backgrounds import (
    MIXED,
    VARIANTS,
    Cutout,
    check_variants,
    cutout,
    pairings,
    variant,
    variant_key,
)
from relicv2.evaluation.features import shard_set_fingerprint
from relicv2.evaluation.views import labelled_samples
from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks
from relicv2.jobs.version import package_version
from relicv2.shards.driver import JobReport, UnitOutput, run_shard_job
from relicv2.shards.images import ImageLoadError, load_gray, load_image, load_scaled, read_bytes
from relicv2.shards.job import (
    MergeReport,
    PlanError,
    ShardJob,
    Unit,
    check_plan,
    digest_of,
    merge_records,
    write_plan,
)
from relicv2.shards.reader import SampleRef
from relicv2.shards.sample import MASK_MEMBER, ShardSample
from relicv2.shards.sample_set import load_sample_set, require_class_labels
from relicv2.shards.shardset import ShardSet, list_shard_files, resolve_shard_set
from relicv2.shards.writer import TarShard, sample_record, shard_name

STATE_DIR = ".backgrounds"
MASK_SUFFIX = ".png"  # ground-truth masks in a folder: KEY.png


class BackgroundsError(ValueError):
    """Inputs the backgrounds test cannot use: one line naming the file and the fix."""


@dataclass(frozen=True)
class VariantSettings:
    """What shapes the composites (part of every unit's digest)."""

    seed: int  # of the pairings
    side: int  # the composites' square: the evaluation's resize size
    crop: int  # the evaluation's centre crop, where the exclusion rules look
    variants: tuple[str, ...] = VARIANTS
    images_per_shard: int = 1000
    quality: int = 95  # JPEG, as `shards build` converts

    def __post_init__(self) -> None:
        check_variants(self.variants)


@dataclass(frozen=True)
class Masks:
    """Where each val image's mask is read: `read(ref)` gives its bytes or None; `identity` changes
    whenever a mask file does."""

    read: Callable[[SampleRef], bytes | None]
    identity: list
    source: str


def mask_source(val: ShardSet, masks: Path | None) -> Masks:
    """The masks of `val`: its own `mask.png` members (masks None), a shard set of them, or a folder of
    KEY.png files; BackgroundsError when there are none."""
    fix = ("build them with `relicv2 saliency build-masks --shards SET --out MASKED` and pass MASKED as --val, "
           "or pass ground-truth masks with --masks")
    if masks is None:
        if not val.has_masks:
            raise BackgroundsError(f"{val} holds no masks ({MASK_MEMBER} members); {fix}")
        return Masks(lambda ref: ref.read(MASK_MEMBER), [], str(val))
    if masks.is_dir() and not list_shard_files(masks):
        files = {p.stem: p for p in sorted(masks.iterdir()) if p.suffix.lower() == MASK_SUFFIX and p.is_file()}
        if not files:
            raise BackgroundsError(f"--masks {masks} holds neither shards nor {MASK_SUFFIX} masks; {fix}")
        identity = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files.values()]
        return Masks(lambda ref: read_bytes(files[ref.key]) if ref.key in files else None, identity, str(masks))
    mask_set = resolve_shard_set(masks)
    if not mask_set.has_masks:
        raise BackgroundsError(f"--masks {masks} holds no masks ({MASK_MEMBER} members); {fix}")
    refs = {ref.key: ref for ref in load_sample_set(mask_set).samples}
    return Masks(lambda ref: refs[ref.key].read(MASK_MEMBER) if ref.key in refs else None,
                 shard_set_fingerprint(mask_set), str(masks))


def square(image: Image.Image, side: int) -> np.ndarray:
    """The image resized (short side, bicubic, as the evaluation view) to `side` and centre-cropped square."""
    resized = TF.resize(image, [side], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return np.asarray(TF.center_crop(resized, [side, side]))


def mask_square(data: bytes, name: str, size: tuple[int, int], side: int) -> np.ndarray | tuple[str, str]:
    """A mask on its image's square (`size`: the image's displayed width, height), or why not: a mask
    stored at a scale of its image is resized to it; one of another shape is refused."""
    mask = Image.fromarray(load_gray(data, name))
    if mask.size != size:
        (mw, mh), (iw, ih) = mask.size, size
        if abs(mw * ih - mh * iw) > (iw + ih) / 2:  # more than rounding at any scale
            return "mask_shape", f"mask {mw}x{mh} is not the shape of its image {iw}x{ih}"
        mask = mask.resize(size, Image.Resampling.BILINEAR)
    return square(mask, side)


@dataclass(frozen=True)
class Screened:
    """The val images the test uses (in reader order, with their labels) and those left out."""

    refs: list[SampleRef]
    labels: np.ndarray
    left_out: list[dict]  # rejected-list rows: source (key), reason, detail

    @property
    def excluded(self) -> dict[str, int]:
        return dict(sorted(Counter(row["reason"] for row in self.left_out).items()))


def composite_input(ref: SampleRef, masks: Masks, settings: VariantSettings, *,
                    full: bool = True) -> tuple[np.ndarray | None, Cutout] | tuple[str, str]:
    """(image square, cutout) of one val image, or (reason, why) it is left out. Not `full` (the screening):
    the image is decoded at a reduced scale, for its size only, and no square is made."""
    name = f"{ref.key} in {ref.tar.name}"
    try:
        if (data := masks.read(ref)) is None:
            return "no_mask", f"no mask for {ref.key} in {masks.source}"
        image = load_image(ref.read_image(), name) if full else None
        size = image.size if image is not None else (lambda s: (s.width, s.height))(
            load_scaled(ref.read_image(), name, min_side=8))
        mask = mask_square(data, f"the mask of {ref.key}", size, settings.side)
    except ImageLoadError as error:
        return "unreadable", str(error)
    cut = mask if isinstance(mask, tuple) else cutout(mask, settings.crop)
    return cut if isinstance(cut, tuple) else (None if image is None else square(image, settings.side), cut)


def screen(refs: list[SampleRef], labels: list[int], masks: Masks, settings: VariantSettings, *, what: str,
           progress: bool = True) -> Screened:
    """Which images the test can use: each mask read, put on its image's square and checked."""
    kept, left_out = [], []
    with Phase("eval backgrounds: screening masks", len(refs), unit="img", enabled=progress) as bar:
        for position, ref in enumerate(refs):
            bar.update(1)
            result = composite_input(ref, masks, settings, full=False)
            if isinstance(result[0], str):
                left_out.append({"source": ref.key, "reason": result[0], "detail": result[1]})
            else:
                kept.append(position)
    if not kept:
        counts = dict(Counter(row["reason"] for row in left_out))
        first = left_out[0]["detail"] if left_out else "the set is empty"
        raise BackgroundsError(f"no image of {what} can be used ({counts}; e.g. {first}); check that the masks "
                               "belong to these images")
    return Screened([refs[i] for i in kept], np.asarray(labels)[kept], left_out)


def jpeg(image: np.ndarray, quality: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, "JPEG", quality=quality)
    return out.getvalue()


@dataclass
class VariantWork:
    """The variant set's part of the shard-job engine (`shards.driver.UnitWork`): unit c * V + v is variant
    v of chunk c; the units of one chunk are made in one pass over its images."""

    out: Path
    screened: Screened
    masks: Masks
    settings: VariantSettings
    plan: dict
    partners: dict[str, np.ndarray]
    classes: list[str] | None = None

    def claim(self, job: ShardJob, ranks: Ranks) -> None:
        write_plan(job, self.plan)

    def inputs(self, number: int) -> None:
        return None  # the digest covers the inputs' files and the settings

    def chunk(self, number: int) -> range:
        size, count = self.settings.images_per_shard, len(self.screened.refs)
        first = number // len(self.settings.variants) * size
        return range(first, min(first + size, count))

    def items(self, number: int) -> int:
        return len(self.chunk(number))

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        names = self.settings.variants
        for _, group in itertools.groupby(numbers, key=lambda n: n // len(names)):
            group = list(group)
            tars = {n: TarShard(self.out / shard_name(names[n % len(names)], n // len(names))) for n in group}
            rejected: dict[int, list[dict]] = {n: [] for n in group}
            try:
                for i in self.chunk(group[0]):
                    self._compose(i, {names[n % len(names)]: n for n in group}, tars, rejected, bar)
                for n in group:
                    if tars[n].rows:
                        tars[n].close()
                    else:
                        tars[n].abort()
            except BaseException:
                for tar in tars.values():
                    tar.abort()
                raise
            for n in group:
                yield UnitOutput(tars[n] if tars[n].rows else None, rejected[n])

    def _compose(self, i: int, units: dict[str, int], tars: dict, rejected: dict, bar: Phase) -> None:
        ref, label = self.screened.refs[i], int(self.screened.labels[i])
        own = composite_input(ref, self.masks, self.settings)
        for name, n in units.items():
            bar.update(1)
            meta = {"source": ref.key, "variant": name, "width": self.settings.side, "height": self.settings.side}
            partner = None
            if name in MIXED:
                j = int(self.partners[MIXED[name]][i])
                partner = own if j == i else composite_input(self.screened.refs[j], self.masks, self.settings)
                meta |= {"background": self.screened.refs[j].key, "background_label": int(self.screened.labels[j])}
            problem = next((p for p in (own, partner) if p is not None and isinstance(p[0], str)), None)
            if problem is not None:  # changed since the screening, or undecodable past its header
                rejected[n].append({"source": ref.key, "reason": problem[0], "detail": problem[1]})
                continue
            image = variant(name, *own, partner)
            sample = ShardSample(variant_key(name, ref.key), {"jpg": jpeg(image, self.settings.quality)}, label, meta)
            tars[n].add_record(sample_record(sample))

    def merge(self, job: ShardJob, records: list[dict]) -> MergeReport:
        info = {"settings": asdict(self.settings), "images": len(self.screened.refs),
                "excluded": self.screened.excluded, "masks": self.masks.source, "version": package_version(),
                **({"classes": self.classes} if self.classes else {})}
        return merge_records(job.out, records, info, rejected=self.screened.left_out)


def plan_variant_set(val: ShardSet, masks: Masks, out: Path, settings: VariantSettings, *,
                     classes: list[str] | None = None, progress: bool = True) -> tuple[ShardJob, VariantWork]:
    """The engine's job and work of the variant set of `val` in `out` (its info.json names `classes`, the val
    set's): the images screened, nothing written. BackgroundsError or PlanError for what it cannot use."""
    refs, broken = labelled_samples(val)
    labels = require_class_labels(refs, val)
    plan = {"settings": asdict(settings), "val": shard_set_fingerprint(val), "masks": masks.identity}
    plan = json.loads(json.dumps({**plan, "digest": digest_of(plan)}))  # as plan.json holds it: lists, not tuples
    try:
        check_plan(ShardJob(out, out / STATE_DIR, ()), plan, other="")
    except PlanError:
        raise BackgroundsError(f"{out} holds the variant set of other images, masks or settings; choose another "
                               f"--output or delete {out}") from None
    screened = screen(list(refs), labels, masks, settings, what=str(val), progress=progress)
    screened.left_out.extend({"source": key, "reason": "broken_sample", "detail": "left out by the shard reader"}
                             for key in sorted(broken))
    chunks = -(-len(screened.refs) // settings.images_per_shard)
    units = [Unit(f"{name}-{c:06d}", shard_name(name, c), digest_of({"plan": plan["digest"], "unit": [name, c]}))
             for c in range(chunks) for name in settings.variants]
    partners = pairings(screened.labels, settings.seed)
    return ShardJob(out, out / STATE_DIR, tuple(units)), VariantWork(out, screened, masks, settings, plan, partners,
                                                                      classes)


def build_variant_set(val: Path | str, masks: Path | None, out: Path, settings: VariantSettings, *,
                      progress: bool = True) -> tuple[JobReport, Screened]:
    """Write (or resume) the variant set of `val` in `out`; BackgroundsError and the engine's errors
    (OutputError, UnfinishedError, PlanError) as they come."""
    val_set = resolve_shard_set(val)
    job, work = plan_variant_set(val_set, mask_source(val_set, masks), out, settings, progress=progress)
    return run_shard_job(job, work, Ranks(), name="eval backgrounds", progress=progress), work.screened


def variant_tars(out: Path, name: str) -> list[Path]:
    """The tars of one variant in a variant set folder."""
    return [tar for tar in list_shard_files(out) if tar.name.startswith(f"{name}-")]

"""Options of the multi-view augmentation (docs/design.md "Views and augmentations", paper Table "aug").

One frozen dataclass holds every view option; the trainer's config embeds it. `view_specs` turns it
into one `ViewSpec` per output view, so the DALI pipeline and the PIL reference read the paper's
odd/even table from a single place.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

from relicv2.jobs.config import RemovedKey
from relicv2.jobs.workers import rank_cores
from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.shards.sample import MIN_MASK_COVERAGE

GRAYSCALE_WEIGHTS = (0.2989, 0.5870, 0.1140)  # paper and torchvision's rgb_to_grayscale
# The views of training and of the evaluation protocols (kNN, linear, fine-tuning), which follow the paper's:
IMAGE_SIZE = 224  # the large views' side, and the evaluation's crop
CROP_RATIO = (3 / 4, 4 / 3)  # a random-resized crop's range of aspect ratios (torchvision's)
FULL_CROP_SCALE = (0.08, 1.0)  # a random-resized crop's range of areas: the paper's even views, the protocols' train views
CENTRE_CROP = 0.875  # the test view: the centre crop's side over the resized short side (224 of 256)
BACKENDS = ("dali", "reference")


def check_crop_scale(key: str, scale: tuple[float, float]) -> None:
    """A random-resized crop's range of areas, (lo, hi) with 0 < lo <= hi <= 1; ValueError naming `key`."""
    if not 0 < scale[0] <= scale[1] <= 1:
        raise ValueError(f"{key} must satisfy 0 < lo <= hi <= 1, got {tuple(scale)}")

COLOUR_KERNELS = ("auto", "select", "fused")
OUTPUT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ViewConfig:
    """Every option of the view pipeline; defaults are the paper's settings.

    Views are numbered from 1: large views 1 and 3 and small view 1 use the "odd" column of the
    paper's table, large views 2 and 4 and small view 2 the "even" column.
    """

    large_views: int = 4
    small_views: int = 2
    large_size: int = IMAGE_SIZE
    small_size: int = 96
    # Random-resized-crop area fractions per column; aspect ratio log-uniform in `crop_ratio`.
    crop_scale_even: tuple[float, float] = FULL_CROP_SCALE
    crop_scale_odd_large: tuple[float, float] = (0.14, 1.0)
    crop_scale_odd_small: tuple[float, float] = (0.05, 0.14)
    crop_ratio: tuple[float, float] = CROP_RATIO
    flip_probability: float = 0.5
    jitter_probability: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1  # fraction of the colour circle, as in torchvision
    # How the torch stage picks each sample's steps: "select" runs a step on the rows that drew it (least
    # arithmetic: CPUs); "fused" runs every row through compiled kernels and keeps the drawn results
    # (fewest launches: GPUs, where launching bounds the stage; 0.54x its GPU time on an H100); "auto":
    # fused on a GPU, select on a CPU.
    colour_kernels: str = "auto"
    grayscale_probability: float = 0.2
    blur_probability_even: float = 1.0
    blur_probability_odd: float = 0.1
    blur_kernel: int = 23
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_probability_even: float = 0.0
    solarize_probability_odd: float = 0.2
    # Saliency masking of large views (paper appendix "Saliency Masking").
    mask_probability: float = 0.1
    mask_min_coverage: float = MIN_MASK_COVERAGE
    mask_grey_range: tuple[float, float] = (0.0, 1.0)  # the per-image background grey level
    # Train although mask_probability and the data disagree (masking on a set without masks, or a
    # masked set with mask_probability 0); otherwise such a run is refused before its first step.
    allow_mask_mismatch: bool = False
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    # Loading.
    backend: str = "dali"  # "reference": PIL/torchvision on a torch DataLoader (no DALI needed)
    output_dtype: str = "float32"  # "bfloat16" halves host->device traffic on GPU
    num_threads: int = 0  # DALI CPU threads / reference workers; 0: auto (2 on CPU; on GPU a rank's cores - 1, 2-8)
    shuffle_buffer: int = 1024  # reader's in-memory shuffle buffer (samples)
    # Batches prepared ahead (DALI's prefetch queue; DataLoader batches per worker). Three keeps a
    # GPU pipeline ahead of a step whose duration varies (logging, kNN, checkpoints).
    prefetch: int = 3
    # Finished batches (on the training device, colour stage done) a background thread keeps ready,
    # across epochs, while the trainer steps; 0: each batch is made when the trainer asks for it.
    # None: 1 on a GPU (the CPU is free while the GPU steps), 0 on a CPU (the trainer uses every core).
    ready_batches: int | None = None
    hw_decoder_load: float = 0.65  # share of JPEG decoding given to the GPU's hardware decoder
    debug_params: bool = False  # also return the drawn augmentation parameters per view
    # Keys of earlier versions: refused in a user's settings, left out of a checkpoint's.
    REMOVED_KEYS: ClassVar[dict[str, RemovedKey]] = {
        "colour_stage": RemovedKey("torch", "the torch colour stage is the only one, the all-DALI one was slower"),
        "hue_model": RemovedKey("hsv", "the hue shift is torchvision's exact HSV one, DALI's YIQ hue went with the "
                                       "all-DALI colour stage"),
    }

    @property
    def jitter_ranges(self) -> tuple[tuple[float, float], ...]:
        """The ranges of the brightness, contrast and saturation factors and the hue shift (torchvision)."""
        factors = [(max(0.0, 1 - s), 1 + s) for s in (self.brightness, self.contrast, self.saturation)]
        return (*factors, (-self.hue, self.hue))

    def __post_init__(self) -> None:
        """Raise ValueError with one sentence naming the option when a value is out of range."""
        if self.large_views < 1 or self.small_views < 0:
            raise ValueError("large_views must be >= 1 and small_views >= 0")
        if self.large_size < 8 or (self.small_views and self.small_size < 8):
            raise ValueError("large_size and small_size must be at least 8 pixels")
        ranges = {"crop_scale_even": " <= 1", "crop_scale_odd_large": " <= 1", "crop_scale_odd_small": " <= 1",
                  "crop_ratio": "", "blur_sigma": ""}  # (min, max) pairs, and the bound on max
        for name, bound in ranges.items():
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi <= (1 if bound else hi):
                raise ValueError(f"{name} must satisfy 0 < min <= max{bound}, got {(lo, hi)}")
        for name in ("flip_probability", "jitter_probability", "grayscale_probability", "blur_probability_even",
                     "blur_probability_odd", "solarize_probability_even", "solarize_probability_odd",
                     "mask_probability", "mask_min_coverage", "hue"):
            value, top = getattr(self, name), 0.5 if name == "hue" else 1
            if not 0.0 <= value <= top:
                raise ValueError(f"{name} must be in [0, {top}], got {value}")
        if min(self.brightness, self.contrast, self.saturation) < 0:
            raise ValueError("brightness, contrast and saturation must be >= 0")
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise ValueError(f"blur_kernel must be odd and positive, got {self.blur_kernel}")
        choices = (("colour_kernels", COLOUR_KERNELS), ("backend", BACKENDS), ("output_dtype", OUTPUT_DTYPES))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.num_threads < 0 or self.shuffle_buffer < 1 or self.prefetch < 1:
            raise ValueError("num_threads must be >= 0 (0: auto), shuffle_buffer and prefetch >= 1")
        if self.ready_batches is not None and self.ready_batches < 0:
            raise ValueError(f"ready_batches must be >= 0 (or null: auto), got {self.ready_batches}")


def resize_of(crop_size: int, resize_size: int = 0) -> int:
    """The test view's short side before the centre crop: `resize_size`, or when 0 crop_size / CENTRE_CROP
    (256 for 224)."""
    return resize_size or round(crop_size / CENTRE_CROP)


def mask_mismatch(cfg: ViewConfig, has_masks: bool) -> str | None:
    """One sentence naming the fix when the masking setting and the data disagree, else None."""
    if cfg.mask_probability > 0 and not has_masks:
        return (f"carries no saliency masks, so views.mask_probability={cfg.mask_probability} would mask nothing: "
                "train on the masked set that `relicv2 saliency build-masks` wrote, or set "
                "views.mask_probability=0 to pretrain without masking")
    if cfg.mask_probability == 0 and has_masks:
        return (f"carries saliency masks that views.mask_probability=0 never applies: set "
                f"views.mask_probability={ViewConfig.mask_probability} (the paper's p_m) to use them")
    return None


@dataclass(frozen=True)
class ViewSpec:
    """The parameters of one output view, resolved from its size class and table column."""

    size: int
    crop_scale: tuple[float, float]
    blur_probability: float
    solarize_probability: float
    mask_probability: float  # 0 for small views: masking applies to large views only


def view_specs(cfg: ViewConfig) -> tuple[ViewSpec, ...]:
    """One spec per output view, large views first, following the paper's odd/even table."""
    specs = []
    for large, count, odd_scale in ((True, cfg.large_views, cfg.crop_scale_odd_large),
                                    (False, cfg.small_views, cfg.crop_scale_odd_small)):
        for number in range(1, count + 1):
            odd = number % 2 == 1
            scale = odd_scale if odd else cfg.crop_scale_even
            specs.append(ViewSpec(
                size=cfg.large_size if large else cfg.small_size,
                crop_scale=scale, mask_probability=cfg.mask_probability if large else 0.0,
                blur_probability=cfg.blur_probability_odd if odd else cfg.blur_probability_even,
                solarize_probability=cfg.solarize_probability_odd if odd else cfg.solarize_probability_even,
            ))
    return tuple(specs)


# Order of the columns of the per-view debug parameter vector (both backends fill it the same way):
# "area" is crop area / image area, "ratio" crop width / height, "order" an index into JITTER_ORDERS (-1 when
# no jitter), "coverage" the sample's mask coverage (0 when it has no mask), "grey" its background grey level.
PARAM_NAMES = ("area", "ratio", "flip", "masked", "jitter", "order", "brightness", "contrast", "saturation",
               "hue", "grayscale", "blur", "sigma", "solarize", "coverage", "grey")
# The columns a backend draws per view, in PARAM_NAMES order (the rest are per sample or the mask's).
DRAWN_PARAM_NAMES = tuple(n for n in PARAM_NAMES if n not in ("masked", "coverage", "grey"))


# Every order of the colour-jitter operations (0 brightness, 1 contrast, 2 saturation, 3 hue): 4! of them.
JITTER_ORDERS: tuple[tuple[int, ...], ...] = tuple(itertools.permutations(range(4)))


CPU_THREADS = 2  # a laptop: the trainer's own threads need the other cores
GPU_THREADS_MAX = 8  # per GPU: decoding is mostly on the GPU, the CPU prepares and feeds it


def ready_batches(cfg: ViewConfig, device: str) -> int:
    """`ready_batches`, or when None (auto) 1 on a GPU and 0 on a CPU."""
    if cfg.ready_batches is not None:
        return cfg.ready_batches
    return 1 if device.startswith("cuda") else 0


def loader_threads(cfg: ViewConfig, device: str, env: dict[str, str] | None = None) -> int:
    """The loader's CPU threads: `num_threads`, or when 0 (auto) CPU_THREADS on a CPU and, on a GPU,
    this rank's share of the cores it may use (torchrun's LOCAL_WORLD_SIZE ranks per node) less one
    for the trainer, between 2 and GPU_THREADS_MAX."""
    if cfg.num_threads > 0:
        return cfg.num_threads
    if not device.startswith("cuda"):
        return CPU_THREADS
    return max(2, min(GPU_THREADS_MAX, rank_cores(env) - 1))

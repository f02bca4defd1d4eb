"""The colour steps of a view as batched torch operations, with the draws the DALI pipeline seeds.

The DALI pipeline renders each view's geometry (decode, crop, resize, flip, and the same crop of the
saliency mask) and one uniform draw per sample that seeds the colour parameters (`colour_params`);
this module then applies the saliency masking (8-bit, as the reference's composite), the paper's
colour steps (jitter in a random order, grayscale, blur, solarize) and the normalisation on the
views' device, with torchvision's float semantics (clamped to [0, 1] after each step, no rounding
between steps). Why not DALI operators: docs/design.md, "Views and augmentations". A step's rows are
known on the host, where the parameters are drawn, so selecting them needs no device synchronisation
(the masked flags, GPU data when the masks are decoded there, are read back by the thread that makes
the batch, not by the trainer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from relicv2.pretrain.views.config import (
    DRAWN_PARAM_NAMES,
    GRAYSCALE_WEIGHTS,
    JITTER_ORDERS,
    ViewConfig,
    ViewSpec,
)

ORDER_TABLE = np.array(JITTER_ORDERS, np.int64)  # [order, slot] -> operation (0 b, 1 c, 2 s, 3 hue)
GREY_COLUMN = 4  # the per-sample values a view's steps read: the 4 jitter factors, then the grey level


@dataclass(frozen=True)
class ColourDraws:
    """One view's colour parameters for a batch, one entry per sample (host arrays)."""

    jitter: np.ndarray  # bool
    order: np.ndarray  # int, index into JITTER_ORDERS
    factors: np.ndarray  # float [B, 4]: brightness, contrast, saturation, hue
    grayscale: np.ndarray  # bool
    blur: np.ndarray  # bool
    sigma: np.ndarray  # float
    solarize: np.ndarray  # bool

    @classmethod
    def from_params(cls, params: np.ndarray) -> ColourDraws:
        """From a B x DRAWN_PARAM_NAMES array, the layout the pipeline returns."""
        col = {n: params[:, i] for i, n in enumerate(DRAWN_PARAM_NAMES)}
        flags = {n: col[n] > 0.5 for n in ("jitter", "grayscale", "blur", "solarize")}
        factors = np.stack([col[n] for n in ("brightness", "contrast", "saturation", "hue")], axis=1)
        return cls(order=np.rint(col["order"]).astype(np.int64), factors=factors,
                   sigma=col["sigma"].astype(np.float64), **flags)

    def for_view(self, spec: ViewSpec) -> ColourDraws:
        """These draws with the steps `spec` never takes switched off: a step of probability 0 is
        not applied, whatever flag was drawn for it."""
        return replace(self, blur=self.blur & (spec.blur_probability > 0),
                       solarize=self.solarize & (spec.solarize_probability > 0))

    @classmethod
    def concat(cls, draws: Sequence[ColourDraws]) -> ColourDraws:
        """The draws of several views as those of one batch, rows in the given order."""
        return cls(**{f.name: np.concatenate([getattr(d, f.name) for d in draws]) for f in fields(cls)})


GEOMETRY_COLUMNS = 3  # DRAWN_PARAM_NAMES starts with the crop's area and ratio and the flip; the colour's follow


def colour_params(pipeline_params: np.ndarray, spec: ViewSpec, cfg: ViewConfig) -> np.ndarray:
    """A view's B x DRAWN_PARAM_NAMES parameters: the pipeline's geometry and the colour steps' draws.

    `pipeline_params` is what the DALI pipeline returns for the view: the geometry columns, then one
    uniform draw per sample whose bits seed this batch's colour draws. The draws follow the paper's
    distributions in numpy: one vectorised call per parameter instead of a DALI random operator per
    parameter and view. Seeded from the pipeline's own draws, they replay exactly wherever the pipeline
    does (a resume from its checkpoint).
    """
    geometry, entropy = pipeline_params[:, :GEOMETRY_COLUMNS], pipeline_params[:, GEOMETRY_COLUMNS]
    rows = len(pipeline_params)
    rng = np.random.default_rng(np.ascontiguousarray(entropy, np.float32).view(np.uint32))

    def coin(probability: float) -> np.ndarray:
        return rng.random(rows) < probability

    return np.column_stack([
        geometry,
        coin(cfg.jitter_probability),
        rng.integers(0, len(JITTER_ORDERS), rows),
        *(rng.uniform(lo, hi, rows) for lo, hi in cfg.jitter_ranges),
        coin(cfg.grayscale_probability),
        coin(spec.blur_probability),
        rng.uniform(*cfg.blur_sigma, rows),
        coin(spec.solarize_probability),
    ]).astype(np.float32)


def _grey(x: torch.Tensor) -> torch.Tensor:
    """torchvision's rgb_to_grayscale (ITU-R 601 weights) of B x 3 x H x W, as B x 1 x H x W."""
    r, g, b = GRAYSCALE_WEIGHTS
    return r * x[:, 0:1] + g * x[:, 1:2] + b * x[:, 2:3]


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (x * factor).clamp_(0.0, 1.0)


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean grey level (torchvision): mean of the luma = luma of the channel means."""
    return torch.lerp(_grey(x.mean(dim=(2, 3), keepdim=True)), x, factor).clamp_(0.0, 1.0)


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return torch.lerp(_grey(x), x, factor).clamp_(0.0, 1.0)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue: H (HSV) rotated by `shift` of the circle, S and V kept.

    The hue in sextants comes from the channel holding the maximum (r before g before b on ties, as
    torchvision); channel n of the result is V - C * clamp(min(k, 4 - k), 0, 1), k = (n + H) mod 6,
    which is torchvision's six-case hsv -> rgb table in one expression.
    """
    value = x.amax(dim=1, keepdim=True)
    chroma = value - x.amin(dim=1, keepdim=True)
    safe = torch.where(chroma == 0, torch.ones_like(chroma), chroma)
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    sextant = torch.where(value == r, (g - b) / safe,
                          torch.where(value == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    turns = torch.remainder(sextant / 6.0 + shift, 1.0)
    offsets = torch.arange(5.0, 0.0, -2.0, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)  # n = 5, 3, 1 for r, g, b
    k = torch.remainder(offsets + 6.0 * turns, 6.0)
    return value - chroma * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


JITTER_STEPS = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)


def gaussian_blur(x: torch.Tensor, sigma: np.ndarray, kernel: int) -> torch.Tensor:
    """torchvision's gaussian_blur (reflect padding) with one sigma per sample, as two 1-D passes.

    The kernel is separable, so a vertical then a horizontal pass give torchvision's 2-D kernel
    (the outer product) at 2k instead of k^2 multiplications a pixel; one grouped convolution per
    pass blurs every channel of every sample with its own kernel. Views smaller than the kernel get
    the largest kernel that fits (reflect padding needs the half-kernel under the view size).
    """
    n, c, h, w = x.shape
    kernel = min(kernel, 2 * min(h, w) - 1)
    half = kernel // 2
    taps = torch.linspace(-half, half, kernel, dtype=torch.float64)
    weights = torch.exp(-0.5 * (taps[None, :] / torch.as_tensor(sigma, dtype=torch.float64)[:, None]) ** 2)
    # non_blocking: a blocking copy waits for every kernel queued on the stream (see _colour).
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(x.device, x.dtype, non_blocking=True)
    weights = weights.repeat_interleave(c, dim=0)
    padded = F.pad(x, (half, half, half, half), mode="reflect").reshape(1, n * c, h + 2 * half, w + 2 * half)
    out = F.conv2d(padded, weights.view(n * c, 1, kernel, 1), groups=n * c)
    out = F.conv2d(out, weights.view(n * c, 1, 1, kernel), groups=n * c)
    return out.view(n, c, h, w)


def replace_background(x: torch.Tensor, grey: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """The saliency masking of a view: grey + (view - grey) * mask, rounded to 8 bits.

    `x` B x 3 x H x W in [0, 1] (8-bit values), `grey` the samples' grey levels in [0, 1], `soft`
    the views' crops of the mask, B x H x W x 1 uint8. Rounded to 8 bits like the DALI blend (and
    PIL's composite in the reference), so the colour steps see the same values on every path.
    """
    keep = soft.permute(0, 3, 1, 2).to(x.dtype) / 255.0
    return torch.lerp(grey, x, keep).mul_(255.0).round_().div_(255.0)


def solarize_view(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0.5, 1.0 - x, x)  # torchvision's solarize at 0.5 on [0, 1] values


class _Rows:
    """Selects a batch's samples by host-side flags, moving two arrays to the device per view.

    Every group of rows a view's steps need is known on the host before any step runs; their
    indices travel as one array and each group is a slice of it, and so do the per-sample values,
    gathered on the host in the same order (a slice per step, no gather kernel on the device): two
    host-to-device copies a view instead of two per step.
    """

    def __init__(self, groups: list[np.ndarray], values: np.ndarray, device: torch.device) -> None:
        self.groups = [np.flatnonzero(g) for g in groups]
        flat = np.concatenate([*self.groups, np.zeros(0, np.int64)])
        self.index = torch.as_tensor(flat).to(device, non_blocking=True)
        self.values = torch.as_tensor(np.asarray(values, np.float32)[flat]).to(device, non_blocking=True)
        self.size = len(values)
        self.starts = np.cumsum([0] + [len(g) for g in self.groups])

    def apply(self, x: torch.Tensor, group: int, step, column: int | None = None,
              aligned: torch.Tensor | None = None) -> torch.Tensor:
        """x[rows] = step(x[rows], values[rows, column], aligned[rows]) for the rows of `group` (the
        last two when given); the other samples are left as they are and cost nothing."""
        count = len(self.groups[group])
        if count == 0:
            return x
        rows = slice(self.starts[group], self.starts[group + 1])
        index = None if count == self.size else self.index[rows]
        args = () if column is None else (self.values[rows, column].view(-1, 1, 1, 1),)
        if aligned is not None:
            args += (aligned if index is None else aligned.index_select(0, index),)
        if index is None:
            return step(x, *args)
        return x.index_copy_(0, index, step(x.index_select(0, index), *args))

    def take(self, x: torch.Tensor, soft: torch.Tensor | None, steps: Sequence[_Step], first: int) -> torch.Tensor:
        """`steps` each on the rows that drew it (the groups from `first`); `soft`: the views' crops of the mask."""
        for i, step in enumerate(steps):
            x = self.apply(x, first + i, step.apply, step.column, soft if step.aligned else None)
        return x


@dataclass(frozen=True)
class Background:
    """What a view needs to have its background replaced (the pipeline's masked views)."""

    masked: np.ndarray  # bool per sample: this view of the sample is masked
    grey: np.ndarray  # per sample, the background grey level in [0, 1]
    soft: torch.Tensor  # B x H x W x 1 uint8: the view's crop of the sample's mask, on the views' device


def colour_view(view: torch.Tensor, draws: ColourDraws, spec: ViewSpec, cfg: ViewConfig,
                background: Background | None = None) -> torch.Tensor:
    """B x H x W x 3 uint8 views (as DALI renders them) -> B x 3 x H x W float32, coloured and normalised
    (the module's steps in the paper's order; the saliency mask where `background` flags a sample)."""
    return _colour(view, draws.for_view(spec), cfg, background)


def colour_views(views: Sequence[torch.Tensor], draws: Sequence[ColourDraws], specs: Sequence[ViewSpec],
                 cfg: ViewConfig, backgrounds: Mapping[int, Background], stack: bool | None = None,
                 fused: bool | None = None) -> list[torch.Tensor]:
    """`colour_view` of every view of a batch; with `stack`, the views of one size as one batch.

    Every step works row by row with each row's own draws, so stacking the views of one size gives each
    view the same pixels as colouring it alone, with a third of the operators: what a launch-bound GPU
    needs, where a CPU was slower stacked (benchmarks/RESULTS.md, "Colour stage and batches made ahead,
    CPU"). `stack` defaults to "on a GPU"; `fused` (see `_colour`) to `cfg.colour_kernels`.
    """
    on_gpu = views[0].device.type != "cpu"
    if stack is None:
        stack = on_gpu
    if fused is None:
        fused = cfg.colour_kernels == "fused" or (cfg.colour_kernels == "auto" and on_gpu)
    out: list[torch.Tensor | None] = [None] * len(views)
    groups: dict[object, list[int]] = {}  # views coloured as one batch: by size when stacking, else one each
    for j, view in enumerate(views):
        groups.setdefault(tuple(view.shape[1:]) if stack else j, []).append(j)
    for members in groups.values():
        stacked = torch.cat([views[j] for j in members]) if len(members) > 1 else views[members[0]]
        joined = ColourDraws.concat([draws[j].for_view(specs[j]) for j in members])
        coloured = _colour(stacked, joined, cfg, _joined_background([backgrounds.get(j) for j in members]), fused)
        for j, part in zip(members, coloured.split(len(views[members[0]])), strict=True):
            out[j] = part
    return out


def _joined_background(parts: list[Background | None]) -> Background | None:
    """The backgrounds of views coloured as one batch; a view without one is never masked (its rows
    of the mask are left uninitialised: no step reads an unmasked row's mask)."""
    present = [b for b in parts if b is not None]
    if not present:
        return None
    if len(parts) == 1:
        return present[0]
    soft = present[0].soft
    rows = len(soft)
    return Background(
        masked=np.concatenate([b.masked if b is not None else np.zeros(rows, bool) for b in parts]),
        grey=np.concatenate([b.grey if b is not None else np.zeros(rows) for b in parts]),
        soft=torch.cat([b.soft if b is not None else soft.new_empty(soft.shape) for b in parts]),
    )


def _colour(view: torch.Tensor, draws: ColourDraws, cfg: ViewConfig, background: Background | None,
            fused: bool = False) -> torch.Tensor:
    """`colour_view` with draws already switched off where their view's spec never takes the step.

    One sequence of steps (`_steps`), taken one of two ways: each step on the rows that drew it (`_Rows`:
    least arithmetic, for CPUs), or with `fused` every row through every step but the blur, the drawn
    results kept (`_every_row`, compiled on a GPU: fewest launches). The blur keeps its row selection:
    its arithmetic (a 23-tap convolution) would grow by more than the launches it saves.
    """
    active = tuple(strength > 0 for strength in (cfg.brightness, cfg.contrast, cfg.saturation, cfg.hue))
    before, after = _steps(active, background is not None)
    masked = background.masked if background is not None else None
    flags = np.column_stack([step.drawn(draws, masked) for step in (*before, *after)])  # B x steps
    values = np.column_stack([draws.factors, background.grey if background is not None else np.zeros(len(flags))])
    if fused:
        table = torch.as_tensor(np.column_stack([values, flags]).astype(np.float32)).to(view.device, non_blocking=True)
        take = functools.partial(_compiled(_every_row) if view.device.type == "cuda" else _every_row, table=table)
        blur_rows, blur_group = _Rows([draws.blur], values[:, :0], view.device), 0
    else:
        blur_rows = _Rows([*flags.T, draws.blur], values, view.device)
        take, blur_group = blur_rows.take, flags.shape[1]
    x = take(_as_float(view), background.soft if background is not None else None, before, 0)
    x = blur_rows.apply(x, blur_group, lambda v: gaussian_blur(v, draws.sigma[draws.blur], cfg.blur_kernel))
    mean, std = _mean_std(cfg, view.device)
    return take(x, None, after, len(before)).sub_(mean).div_(std)


def _mean_std(cfg: ViewConfig, device: torch.device) -> torch.Tensor:
    """The normalisation's mean and std on `device`, 2 x 1 x 3 x 1 x 1, in one non-blocking copy (see
    `gaussian_blur`: two blocking copies a view would be 12 waits a batch)."""
    return torch.tensor([cfg.mean, cfg.std]).to(device, non_blocking=True).view(2, 1, 3, 1, 1)


@dataclass(frozen=True)
class _Step:
    """A colour step as a batch takes it: `apply(x, [the rows' value], [their crops of the mask])` on the
    rows `drawn(draws, masked)` picks."""

    apply: Callable[..., torch.Tensor]
    drawn: Callable[[ColourDraws, np.ndarray], np.ndarray]
    column: int | None = None  # the value it reads per row: a column of the 4 jitter factors, then the grey level
    aligned: bool = False  # it reads the view's crop of the mask


def grayscale_view(x: torch.Tensor) -> torch.Tensor:
    return _grey(x).repeat(1, 3, 1, 1)


MASKING = _Step(replace_background, lambda draws, masked: masked, GREY_COLUMN, aligned=True)
GRAYSCALE = _Step(grayscale_view, lambda draws, masked: draws.grayscale)
SOLARIZE = _Step(solarize_view, lambda draws, masked: draws.solarize)


def _jitter_step(slot: int, op: int) -> _Step:
    """Jitter operation `op` on the rows whose order puts it in `slot`."""
    return _Step(JITTER_STEPS[op], lambda draws, masked: draws.jitter & (ORDER_TABLE[draws.order][:, slot] == op), op)


@functools.cache
def _steps(active: tuple[bool, ...], masked: bool) -> tuple[tuple[_Step, ...], tuple[_Step, ...]]:
    """The paper's steps before the blur (the masking when the view may be masked, the jitter operations
    slot by slot, grayscale) and after it (solarize); a jitter operation of strength 0 (`active` False)
    draws the identity and is left out. Cached: the same objects each batch, which a compiled function of
    them checks, so it is traced once."""
    ops = range(len(JITTER_STEPS))
    jitter = tuple(_jitter_step(slot, op) for slot in ops for op in ops if active[op])
    return ((MASKING,) if masked else ()) + jitter + (GRAYSCALE,), (SOLARIZE,)


def _as_float(view: torch.Tensor) -> torch.Tensor:  # B x H x W x 3 uint8 -> B x 3 x H x W float32 in [0, 1]
    return view.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)


def _every_row(x: torch.Tensor, soft: torch.Tensor | None, steps: tuple[_Step, ...], first: int, *,
               table: torch.Tensor) -> torch.Tensor:
    """`steps` on every row, each result kept where the row drew the step (`table`: the per-row values,
    then the flags of `_steps`, these from column `first`): the operations, and every shape, are the same
    for every batch, so torch.compile fuses them into a few kernels with no row selection on the host.
    The same values as `_Rows.take` (the masking blend rounds to 8 bits, and with whole-step grey levels
    no blended value sits near a rounding boundary, so the two ways' last-ulp differences cannot flip
    one), at ~4x its arithmetic."""
    for i, step in enumerate(steps):
        args = () if step.column is None else (table[:, step.column].view(-1, 1, 1, 1),)
        args += (soft,) if step.aligned else ()
        x = torch.where(table[:, VALUES + first + i].view(-1, 1, 1, 1) > 0.5, step.apply(x, *args), x)
    return x


VALUES = GREY_COLUMN + 1  # the per-row values before the flags in `_every_row`'s table


@functools.cache
def _compiled(step):
    """`step` compiled for the GPU (static shapes: a loader's batches all have the same), once per process.
    On a CPU the same function runs eagerly: there the stage is bound by arithmetic, not launches."""
    return torch.compile(step, dynamic=False)

"""The frame every handcrafted method runs in (``guarded_map``): artificial-frame removal, tiny-image
upscaling, the flat-image guard, and the final map back at the original image's size (frame pixels 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np

from relicv2.saliency.handcrafted.colour import as_rgb

MIN_SIDE = 32
"""Images with a shorter side are upscaled before segmentation (and the map scaled back)."""


@dataclass(frozen=True)
class Frame:
    """Crop box of an image without its artificial frame: rows top:bottom, cols left:right."""

    height: int
    width: int
    top: int
    bottom: int
    left: int
    right: int

    @property
    def has_frame(self) -> bool:
        return (self.top, self.bottom, self.left, self.right) != (0, self.height, 0, self.width)

    def crop(self, image: np.ndarray) -> np.ndarray:
        return image[self.top : self.bottom, self.left : self.right]

    def paste(self, saliency: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """Put a map of the cropped image back into a full-size float32 map (frame = ``fill``)."""
        full = np.full((self.height, self.width), fill, dtype=np.float32)
        full[self.top : self.bottom, self.left : self.right] = saliency
        return full


def _sobel_edges(gray: np.ndarray) -> np.ndarray:
    """MATLAB ``edge(I, 'sobel')`` with its default threshold and thinning (RBD's frame test)."""
    g = gray.astype(np.float64) / 255.0
    # MATLAB uses fspecial('sobel') / 8 with replicate padding; cv2 correlates like imfilter
    gx = cv2.Sobel(g, cv2.CV_64F, 1, 0, ksize=3, borderType=cv2.BORDER_REPLICATE) / 8.0
    gy = cv2.Sobel(g, cv2.CV_64F, 0, 1, ksize=3, borderType=cv2.BORDER_REPLICATE) / 8.0
    mag = gx * gx + gy * gy
    cutoff = 4.0 * mag.mean()
    padded = np.pad(mag, 1, mode="constant")
    left, right = padded[1:-1, :-2], padded[1:-1, 2:]
    up, down = padded[:-2, 1:-1], padded[2:, 1:-1]
    ax, ay = np.abs(gx), np.abs(gy)
    along_x = (ax >= ay) & (mag >= left) & (mag > right)
    along_y = (ay >= ax) & (mag >= up) & (mag > down)
    return (mag > cutoff) & (along_x | along_y)


def detect_frame(rgb: np.ndarray, edges: Literal["sobel", "canny", "none"] = "sobel", min_sides: int = 1,
                 max_width: int = 30, density: float = 0.6) -> Frame:
    """The crop box of ``rgb`` without its artificial frame (authors' ``removeframe``; edges "none": none).

    A frame side is the last of the first ``max_width`` pixel lines (from that side) whose edge
    density exceeds ``density``. RBD uses Sobel edges and accepts any one side; the MR C++ code
    uses Canny(60, 150) and needs ``min_sides=2``. Undetected sides get the widest detected
    width, as in the original. A crop that would leave < 16 px is not applied.
    """
    height, width = rgb.shape[:2]
    none = Frame(height, width, 0, height, 0, width)
    if edges == "none" or height < 2 * max_width or width < 2 * max_width:
        return none
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    edge_map = _sobel_edges(gray) if edges == "sobel" else cv2.Canny(gray, 60, 150) > 0
    rows, cols = edge_map.mean(axis=1), edge_map.mean(axis=0)
    widths = []
    for profile in (rows, rows[::-1], cols, cols[::-1]):  # top, bottom, left, right
        hits = np.flatnonzero(profile[:max_width] > density)
        widths.append(int(hits[-1]) + 1 if hits.size else 0)
    if sum(w > 0 for w in widths) < max(1, min_sides):
        return none
    widest = max(widths)
    top, bottom, left, right = (w if w > 0 else widest for w in widths)
    if height - top - bottom < 16 or width - left - right < 16:
        return none
    return Frame(height, width, top, height - bottom, left, width - right)


@dataclass(frozen=True)
class Prepared:
    """An image made safe for a method (``rgb``: RGB, frame removed, at least ``MIN_SIDE`` px a side);
    ``finish`` turns its map into the original image's float32 map, in [0, 1] and without NaN."""

    rgb: np.ndarray
    frame: Frame

    def finish(self, saliency: np.ndarray) -> np.ndarray:
        sal = np.asarray(saliency, dtype=np.float32)
        crop_h, crop_w = self.frame.bottom - self.frame.top, self.frame.right - self.frame.left
        if sal.shape != (crop_h, crop_w):
            sal = cv2.resize(sal, (crop_w, crop_h), interpolation=cv2.INTER_LINEAR)
        sal = np.nan_to_num(sal, nan=0.0, posinf=0.0, neginf=0.0)
        return self.frame.paste(np.clip(sal, 0.0, 1.0))


def prepare(image: np.ndarray, remove_frame: Literal["sobel", "canny", "none"] = "sobel",
            min_frame_sides: int = 1, min_side: int = MIN_SIDE) -> Prepared:
    """Convert to RGB, remove an artificial frame, and upscale tiny images keeping the aspect ratio, so
    that every side has at least ``min_side`` pixels, enough for a few superpixels."""
    rgb = as_rgb(image)
    frame = detect_frame(rgb, edges=remove_frame, min_sides=min_frame_sides)
    work = frame.crop(rgb)
    short = min(work.shape[:2])
    if short < min_side:
        scale = min_side / short
        new_w = max(min_side, int(round(work.shape[1] * scale)))
        new_h = max(min_side, int(round(work.shape[0] * scale)))
        work = cv2.resize(work, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    return Prepared(rgb=np.ascontiguousarray(work), frame=frame)


def is_flat(rgb: np.ndarray, tolerance: float = 1.0) -> bool:
    """True when the image is (nearly) one colour: every channel spans < ``tolerance`` levels."""
    flat = rgb.reshape(-1, rgb.shape[-1])
    return bool(np.all(flat.max(axis=0).astype(np.int32) - flat.min(axis=0) < tolerance))


def guarded_map(image: np.ndarray, compute: Callable[[np.ndarray], np.ndarray | None], *,
                remove_frame: Literal["sobel", "canny", "none"] = "none",
                min_frame_sides: int = 1) -> np.ndarray:
    """Run a method's ``compute(rgb) -> HxW map`` inside the shared guard (see the module doc).

    ``compute`` gets the prepared uint8 RGB image and returns its map (any float dtype, values
    in [0, 1]) or None when there is nothing to rank (too few superpixels); a flat image never
    reaches it: with no colour contrast every method would only measure the distance to the
    border, a centre blob that says nothing about the image.
    """
    prepared = prepare(image, remove_frame=remove_frame, min_frame_sides=min_frame_sides)
    saliency = None if is_flat(prepared.rgb) else compute(prepared.rgb)
    if saliency is None:
        saliency = np.zeros(prepared.rgb.shape[:2], np.float32)
    return prepared.finish(saliency)

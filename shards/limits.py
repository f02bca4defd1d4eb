"""The one size policy for untrusted images and tar members (decompression bombs, huge members, deep JSON),
applied by every reader of the project from headers, before a pixel is decoded or a byte read. The defaults
are generous for photographs (ImageNet's largest image is ~ 40 Mpx) and can be raised per job.
"""

from __future__ import annotations

from dataclasses import dataclass

# PIL's own warning threshold (~ 9459 x 9459): large enough for any camera photo, small enough
# that one decoded image (3 bytes per pixel, ~ 270 MB) cannot exhaust a worker's memory.
DEFAULT_MAX_PIXELS = 89_478_485


@dataclass(frozen=True)
class ImageLimits:
    """Limits applied to every untrusted image, tar member and json member."""

    max_pixels: int = DEFAULT_MAX_PIXELS  # width x height above which an image is refused ("too_large")
    # A tar member (or image file) larger than this is refused before reading: no image a pipeline should
    # train on is this large, and reading a member means holding it in memory.
    max_member_bytes: int = 256 << 20
    # When set, a decoded image's longer side is downscaled to it (JPEGs decoded at a reduced scale directly),
    # for saliency work; `shards build` never downscales (the shards keep the original pixels).
    max_side: int | None = None
    # A sample's json member holds a few scalars (source, size, class name, mask statistics): one larger, or
    # nesting arrays and objects deeper, is not metadata: refused unparsed (deep JSON exhausts a stack).
    max_json_bytes: int = 1 << 20
    max_json_depth: int = 32

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_member_bytes", "max_json_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.max_side is not None and self.max_side < 1:
            raise ValueError(f"max_side={self.max_side} must be positive (or None for no downscaling)")


DEFAULT_LIMITS = ImageLimits()

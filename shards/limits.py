"""The one size policy for untrusted images and tar members (decompression bombs, huge members, deep JSON).

Every reader in the project (shards build and verify, the shard reader, saliency's image reading,
kNN preprocessing) applies these limits: an image's pixel count is checked from its header before
any pixel is decoded, a tar member's size from its header before any byte is read. Defaults are
generous for photographs (ImageNet's largest image is ~ 40 Mpx) and can be raised per job.
"""

from __future__ import annotations

from dataclasses import dataclass

# PIL's own warning threshold (~ 9459 x 9459): large enough for any camera photo, small enough
# that one decoded image (3 bytes per pixel, ~ 270 MB) cannot exhaust a worker's memory.
DEFAULT_MAX_PIXELS = 89_478_485


@dataclass(frozen=True)
class ImageLimits:
    """Limits applied to every untrusted image.

    max_pixels: width x height above which an image is refused ("too_large"), checked from the header.
    max_side: when set, decoded images whose longer side exceeds it are downscaled to it (JPEGs are
      decoded at a reduced scale directly); for saliency work, which does not need full resolution.
      `shards build` never downscales (the shards keep the original pixels).
    """

    max_pixels: int = DEFAULT_MAX_PIXELS
    # A tar member (or image file) larger than this is refused before reading: no image a pipeline should
    # train on is this large, and reading a member means holding it in memory.
    max_member_bytes: int = 256 << 20
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

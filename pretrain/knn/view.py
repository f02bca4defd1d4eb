"""The evaluation's test view of an image (short side resized, centre crop), before normalisation: PIL only.

Torch-free so that the processes that only make views (the corruption workers of `eval robustness`) never
import torch: torchvision's import brings torch and torch._dynamo with it, about 0.7 GB resident and 3 CPU
seconds a process. The two steps are torchvision's `resize` (one size: the short side) and `center_crop` of a
PIL image, which call PIL themselves; written here with PIL's calls and torchvision's size and offset rules
(tests/evaluation/test_views.py checks them pixel for pixel against torchvision).
"""

from __future__ import annotations

from PIL import Image

from relicv2.pretrain.views.config import resize_of
from relicv2.shards.images import load_image


def short_side_size(width: int, height: int, short: int) -> tuple[int, int]:
    """(width, height) with the short side `short` and the long side scaled and floored (torchvision's rule)."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def centre_crop_box(width: int, height: int, crop: int) -> tuple[int, int, int, int]:
    """PIL's crop box of the centre `crop` x `crop` square. A side shorter than the crop is padded with black,
    (crop - side) // 2 before it (torchvision's padding); PIL's crop fills outside the image with black."""
    def start(side: int) -> int:
        return -((crop - side) // 2) if crop > side else int(round((side - crop) / 2.0))

    left, top = start(width), start(height)
    return left, top, left + crop, top + crop


def test_view_image(jpeg: bytes, *, crop_size: int, resize_size: int = 0, name: str = "image") -> Image.Image:
    """Image bytes -> the test view before normalisation: the displayed image (EXIF orientation applied, as
    in training), short side resized (bicubic) to `resize_of` the crop, centre-cropped. A bad image raises
    ImageLoadError naming `name`."""
    image = load_image(jpeg, name)
    size = short_side_size(*image.size, resize_of(crop_size, resize_size))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    if image.size == (crop_size, crop_size):
        return image
    return image.crop(centre_crop_box(*image.size, crop_size))

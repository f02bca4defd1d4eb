"""The ResNet encoders' architecture table, without torch: a config checks a depth or a width against it, a
weights file's depth is read back from it (`depth_of`), and `models.resnet` builds the networks it lists."""

# The kind of residual block and the blocks per stage. ResNet-200 is not in torchvision; its layout is the one
# of He et al. 2016 ("Identity Mappings in Deep Residual Networks") used by BYOL/ReLICv2 for their largest encoder.
STAGE_BLOCKS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
    200: ("bottleneck", (3, 24, 36, 3)),
}
WIDTHS = (1, 2, 4)
STAGE_PLANES = (64, 128, 256, 512)
# "torch": symmetric padding k // 2 (torchvision); "same_tf": TensorFlow/JAX "SAME" padding, which
# pads strided layers asymmetrically (more after than before), as the authors' haiku networks do.
PADDINGS = ("torch", "same_tf")


def depth_of(bottleneck: bool, blocks: tuple[int, ...]) -> int | None:
    """The depth with `blocks` residual blocks per stage, bottlenecks or basic ones; None when none has."""
    return next((depth for depth, (kind, layout) in STAGE_BLOCKS.items()
                 if layout == blocks and (kind == "bottleneck") == bottleneck), None)

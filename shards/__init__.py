"""WebDataset shard sets: writing, reading, manifests, DALI index files, building and verification."""

from relicv2.shards.images import ImageLoadError, load_image, load_rgb
from relicv2.shards.index import index_path, read_index, write_index
from relicv2.shards.limits import ImageLimits
from relicv2.shards.manifest import read_manifest, read_rejected
from relicv2.shards.reader import ReadReport, iter_samples, list_shards
from relicv2.shards.sample import IMAGE_MEMBERS, ShardSample
from relicv2.shards.shardset import ShardSet, ShardSetError, resolve_shard_set
from relicv2.shards.verify import verify_shard_set
from relicv2.shards.writer import write_shard_set

__all__ = [
    "IMAGE_MEMBERS",
    "ImageLimits",
    "ImageLoadError",
    "ReadReport",
    "ShardSet",
    "ShardSetError",
    "load_image",
    "load_rgb",
    "resolve_shard_set",
    "ShardSample",
    "index_path",
    "iter_samples",
    "list_shards",
    "read_index",
    "read_manifest",
    "read_rejected",
    "verify_shard_set",
    "write_index",
    "write_shard_set",
]

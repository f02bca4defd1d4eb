"""WebDataset shard sets: writing, reading, manifests, DALI index files, building and verification."""

from shards.images import ImageLoadError, load_image, load_rgb
from shards.index import index_path, read_index, write_index
from shards.limits import ImageLimits
from shards.manifest import read_manifest, read_rejected
from shards.reader import ReadReport, iter_samples, list_shards
from shards.sample import IMAGE_MEMBERS, ShardSample
from shards.shardset import ShardSet, ShardSetError, resolve_shard_set
from shards.verify import verify_shard_set
from shards.writer import write_shard_set

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

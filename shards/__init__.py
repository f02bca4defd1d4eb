"""WebDataset shard sets: writing, reading, manifests, DALI index files, building and verification."""

from jobs.ranks import Ranks, ranks_from_env
from shards.build import BuildConfig, BuildReport, build_shards
from shards.images import ImageLoadError, load_image, load_rgb
from shards.index import index_path, read_index, write_index
from shards.limits import DEFAULT_LIMITS, ImageLimits
from shards.manifest import read_manifest, read_rejected, write_manifest
from shards.merge import MergeReport, merge_shard_set
from shards.reader import ReadReport, iter_samples, list_shards
from shards.sample import IMAGE_MEMBERS, ShardSample
from shards.shardset import ShardSet, ShardSetError, resolve_shard_set
from shards.verify import VerifyReport, verify_shard_set
from shards.writer import write_shard_set

__all__ = [
    "DEFAULT_LIMITS",
    "IMAGE_MEMBERS",
    "BuildConfig",
    "ImageLimits",
    "ImageLoadError",
    "ReadReport",
    "ShardSet",
    "ShardSetError",
    "load_image",
    "load_rgb",
    "resolve_shard_set",
    "BuildReport",
    "MergeReport",
    "Ranks",
    "ShardSample",
    "VerifyReport",
    "build_shards",
    "index_path",
    "iter_samples",
    "list_shards",
    "merge_shard_set",
    "ranks_from_env",
    "read_index",
    "read_manifest",
    "read_rejected",
    "verify_shard_set",
    "write_index",
    "write_manifest",
    "write_shard_set",
]

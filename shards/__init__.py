"""WebDataset shard sets: writing, reading, manifests, DALI index files, building and verification."""

from shards.build import BuildConfig, BuildReport, Ranks, build_shards, ranks_from_env
from shards.index import index_path, read_index, write_index
from shards.manifest import read_manifest, read_rejected, write_manifest
from shards.merge import MergeReport, merge_shard_set
from shards.reader import iter_samples, list_shards
from shards.sample import ShardSample
from shards.verify import VerifyReport, verify_shard_set
from shards.writer import write_shard, write_shard_set

__all__ = [
    "BuildConfig",
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
    "write_shard",
    "write_shard_set",
]

#!/usr/bin/env bash
# Multi-GPU / multi-node launch of any relicv2 job under torchrun.
# Usage: NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 docker/torchrun.sh pretrain --config configs/imagenet-r50-1000ep.yaml ...
set -euo pipefail
exec torchrun \
  --nnodes="${NNODES:-1}" \
  --node-rank="${NODE_RANK:-0}" \
  --nproc-per-node="${NPROC_PER_NODE:-gpu}" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" \
  --master-port="${MASTER_PORT:-29500}" \
  -m cli "$@"

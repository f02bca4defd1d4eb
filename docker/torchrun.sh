#!/usr/bin/env bash
# Launch one relicv2 job under torchrun: every process runs `python -m relicv2 JOB ARGS...` as one rank.
# Jobs that use the ranks: `pretrain` (DDP), `saliency build-masks` (disjoint input shards per rank),
# `eval knn|linear`, `shards build`. The same command runs on one machine or on every node of many.
#
# Usage: docker/torchrun.sh [--dry-run] JOB [ARGS...]
#   # one node, one process per GPU:
#   docker/torchrun.sh pretrain --config imagenet-r50-1000ep \
#       --set data.train_shards=/data/shards/masked-train --output /runs/r50
#   docker/torchrun.sh saliency build-masks --model /runs/saliency/model.pt \
#       --shards /data/shards/train --out /data/shards/masked-train --device cuda
#   # two CPU processes (laptop, CI):
#   NPROC_PER_NODE=2 docker/torchrun.sh pretrain --config demo-cpu --set run.device=cpu
#   # several nodes: run the same line on every node (docker/slurm.sbatch does it under SLURM):
#   NNODES=4 RDZV_ENDPOINT=node01:29500 RDZV_ID=job42 docker/torchrun.sh pretrain ...
#
# Environment (defaults in brackets):
#   NNODES [1]             number of nodes; with 1 and no RDZV_ENDPOINT a standalone rendezvous is used
#   NPROC_PER_NODE [gpu]   processes per node: "gpu" (one per visible GPU), "cpu" or a number
#   RDZV_ENDPOINT          host:port of the c10d rendezvous (the head node), required when NNODES > 1
#   RDZV_ID [relicv2]      identifies the job at the rendezvous (SLURM: the job id)
#   MAX_RESTARTS [3]       on a failed rank or node, restart every worker up to this many times; a
#                          restarted `pretrain` resumes from the newest checkpoint in its output folder
#   PYTHON [python3]       interpreter that runs torchrun and the workers
#   DRY_RUN [0]            1: print the command instead of running it (same as --dry-run)
set -euo pipefail

if [[ "${1:-}" == "--dry-run" ]]; then
  DRY_RUN=1
  shift
fi
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi

nnodes=${NNODES:-1}
nproc=${NPROC_PER_NODE:-gpu}
max_restarts=${MAX_RESTARTS:-3}
python=${PYTHON:-python3}

cmd=("$python" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc"
     --max-restarts="$max_restarts")
if [[ "$nnodes" == "1" && -z "${RDZV_ENDPOINT:-}" ]]; then
  # One machine: torchrun picks a free port itself, so parallel jobs on one host do not collide.
  cmd+=(--standalone)
else
  if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "torchrun.sh: NNODES=$nnodes needs RDZV_ENDPOINT=head-node:port (the same on every node)" >&2
    exit 2
  fi
  cmd+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-relicv2}")
fi
cmd+=(-m relicv2 "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
if [[ "$nproc" == "gpu" ]] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  # torchrun's own answer is a traceback ("Cuda is not available") from every launch.
  echo "torchrun.sh: NPROC_PER_NODE=gpu (the default) but no GPU is visible; set NPROC_PER_NODE=N to run N CPU processes" >&2
  exit 2
fi
exec "${cmd[@]}"

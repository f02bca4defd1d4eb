#!/usr/bin/env bash
# Container entrypoint: `docker run IMAGE pretrain ...` runs `relicv2 pretrain ...`; the launchers and a
# shell run as themselves (`docker run IMAGE torchrun.sh pretrain ...`, `docker run -it IMAGE bash`).
set -euo pipefail

# DALI and the PyTorch data workers pass batches through /dev/shm; Docker's default is 64 MiB.
shm_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $2}' || true)
if [[ -n "$shm_kib" && "$shm_kib" -lt $((2 * 1024 * 1024)) && -z "${RELICV2_QUIET_SHM:-}" ]]; then
  echo "relicv2: /dev/shm is only $((shm_kib / 1024)) MiB; start the container with --ipc=host" \
       "(or --shm-size=16g) or data loading may fail with bus errors (RELICV2_QUIET_SHM=1 hides this)" >&2
fi

case "${1:-}" in
  torchrun.sh|slurm.sbatch|torchrun|python|python3|bash|sh) exec "$@" ;;
  *) exec relicv2 "$@" ;;
esac

#!/usr/bin/env bash
# The whole pipeline on the built-in demo data, on CPU. Usage: scripts/demo.sh [python]
set -euo pipefail
PY=${1:-python}
OUT=${DEMO_OUT:-demo-out}
relicv2() { "$PY" -m cli "$@"; }

rm -rf "$OUT"
relicv2 demo-data "$OUT/images"
relicv2 shards build "$OUT/images/train" "$OUT/shards/train" --max-count 64
relicv2 shards build "$OUT/images/val" "$OUT/shards/val" --max-count 64
relicv2 shards verify "$OUT/shards/train"
relicv2 shards verify "$OUT/shards/val"
echo "demo finished: outputs under $OUT/"

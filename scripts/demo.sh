#!/usr/bin/env bash
# The whole pipeline on the built-in demo data, on CPU. Usage: scripts/demo.sh [python]
# Outputs under $DEMO_OUT (default demo-out/); the pretraining run goes to demo-out/run.
set -euo pipefail
PY=${1:-python}
OUT=${DEMO_OUT:-demo-out}
relicv2() { "$PY" -m cli "$@"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

rm -rf "$OUT"
echo "== 1. demo images (photos bundled with scikit-image, no download)"
relicv2 demo-data "$OUT/images"

echo "== 2. shards (the awkward demo files are converted or rejected, see rejected.parquet)"
relicv2 shards build "$OUT/images/train" "$OUT/shards/train" --max-count 64 --workers 2 --no-progress
relicv2 shards build "$OUT/images/val" "$OUT/shards/val" --max-count 64 --workers 2 --no-progress
relicv2 shards verify "$OUT/shards/train"
relicv2 shards verify "$OUT/shards/val"

echo "== 3. handcrafted saliency (RBD, MR, DSR, MC) on the val shards, and a contact sheet"
relicv2 saliency handcrafted --method all --input "$OUT/shards/val" --output "$OUT/saliency" --workers 2
relicv2 saliency preview --input "$OUT/images/val/astronaut" --output "$OUT/saliency-preview.png" --count 3

echo "== 4. a look at the augmented views (4 large + 2 small per image)"
relicv2 pretrain preview-views --shards "$OUT/shards/train" --output "$OUT/views.png" --count 4 \
    --large-size 96 --small-size 48

echo "== 5. ReLICv2 pretraining (ResNet-18, 64 px) with a kNN monitor"
relicv2 pretrain --config configs/demo-cpu.yaml --output "$OUT/run" \
    --set data.train_shards="$OUT/shards/train" --set knn.train_shards="$OUT/shards/train" \
    --set knn.val_shards="$OUT/shards/val"

echo "== 6. kNN evaluation of the final checkpoint vs a random-init encoder"
relicv2 eval knn --checkpoint "$OUT/run" --train "$OUT/shards/train" --val "$OUT/shards/val" \
    --crop-size 64 --resize-size 64 --device cpu
relicv2 eval knn --random-init 18 --train "$OUT/shards/train" --val "$OUT/shards/val" \
    --crop-size 64 --resize-size 64 --device cpu
echo "demo finished: outputs under $OUT/"

#!/usr/bin/env bash
# Reproduce every GPU figure of the trainer and view pipeline on this machine's GPU, then print a table.
#
#   benchmarks/gpu.sh [WORK_DIR]        (default WORK_DIR: a new temporary folder)
#
# Needs a CUDA GPU, torch and (for the view pipeline) NVIDIA DALI. Environment knobs:
#   PYTHON (default python), BATCH (256), STEPS (20), THREADS (8 CPU threads for DALI), IMAGES (2000 demo
#   images for the end-to-end run), SKIP_VIEWS=1 / SKIP_PRETRAIN=1 to leave a part out.
# Figures: bench_step.py (eager, compiled, batch 2x with activation checkpointing), bench_views.py (DALI
# mixed vs the reference DataLoader), `relicv2 pretrain` on a shard set (images/s and data wait per step
# from metrics.jsonl after warm-up), and benchmarks/bench_build_masks.py when it exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t relicv2-gpu-XXXXXX)}"
PYTHON="${PYTHON:-python}"
BATCH="${BATCH:-256}"
STEPS="${STEPS:-20}"
THREADS="${THREADS:-8}"
IMAGES="${IMAGES:-2000}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"
LOG="$WORK/figures.tsv"
: > "$LOG"

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible: this script measures GPU figures')"
echo "GPU: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())'); work folder $WORK"

record() {  # record NAME FILE: the "throughput"/"peak memory"/"ratio" lines of a bench_step output
  local name="$1" file="$2"
  "$PYTHON" - "$name" "$file" >> "$LOG" <<'PY'
import re, sys
name, text = sys.argv[1], open(sys.argv[2]).read()
def find(pattern):
    m = re.search(pattern, text)
    return m.group(1) if m else "-"
print("\t".join([name, find(r"throughput ([\d.]+) images/s"), find(r"peak memory ([\d.]+ GiB)"),
                 find(r"bare encoder = ([\d.]+x)")]))
PY
}

step() {  # step NAME ARGS...: one bench_step.py run, its output kept in WORK
  local name="$1"; shift
  echo "== bench_step $name: $*"
  if "$PYTHON" "$ROOT/benchmarks/bench_step.py" --device cuda --bf16 --channels-last --steps "$STEPS" "$@" \
      > "$WORK/step-$name.txt" 2>&1; then
    cat "$WORK/step-$name.txt"; record "step $name" "$WORK/step-$name.txt"
  else
    tail -n 3 "$WORK/step-$name.txt"; printf 'step %s\tfailed (see %s)\t-\t-\n' "$name" "$WORK/step-$name.txt" >> "$LOG"
  fi
}

step "R50 batch $BATCH eager" --batch "$BATCH"
step "R50 batch $BATCH compiled" --batch "$BATCH" --compile
step "R50 batch $((BATCH * 2)) compiled" --batch "$((BATCH * 2))" --compile
step "R50 batch $((BATCH * 2)) compiled+ckpt" --batch "$((BATCH * 2))" --compile --activation-checkpointing

if [[ "${SKIP_VIEWS:-0}" != 1 ]]; then
  echo "== bench_views: DALI mixed vs reference, batch $BATCH, $THREADS threads"
  if "$PYTHON" "$ROOT/benchmarks/bench_views.py" --device cuda --batch "$BATCH" --threads "$THREADS" \
      > "$WORK/views.txt" 2>&1; then
    cat "$WORK/views.txt"
    grep -E "images/s wall" "$WORK/views.txt" | sed -E 's/^([a-z-]+) +\(([a-z]+)\): +([0-9.]+) images\/s.*/views \1 (\2)\t\3\t-\t-/' >> "$LOG"
  else
    tail -n 3 "$WORK/views.txt"; printf 'views\tfailed (see %s)\t-\t-\n' "$WORK/views.txt" >> "$LOG"
  fi
fi

if [[ "${SKIP_PRETRAIN:-0}" != 1 ]]; then
  echo "== relicv2 pretrain on $IMAGES demo images (R50, 224 px, batch $BATCH, GPU defaults)"
  per_class=$(( IMAGES / 6 ))
  [[ -d "$WORK/images" ]] || "$PYTHON" -m cli demo-data "$WORK/images" --train-per-class "$per_class" \
      --val-per-class 2 --size 256 > /dev/null
  [[ -f "$WORK/shards/manifest.parquet" ]] || "$PYTHON" -m cli shards build "$WORK/images/train" "$WORK/shards" \
      --workers "$THREADS" --no-progress > /dev/null
  rm -rf "$WORK/run"
  "$PYTHON" -m cli pretrain --config "$ROOT/configs/imagenet-r50-1000ep.yaml" --output "$WORK/run" \
      --set data.train_shards="$WORK/shards" --set optim.global_batch="$BATCH" --set run.device=cuda \
      --set views.mask_probability=0.0 --set knn.train_shards= --set knn.val_shards= --set run.log_every=1 \
      --set run.max_steps=$(( 3 * IMAGES / BATCH )) --set run.checkpoint_every=100000 --set run.progress_bar=false \
      > "$WORK/pretrain.txt" 2>&1 || { tail -n 5 "$WORK/pretrain.txt"; exit 1; }
  grep -E "torch.compile" "$WORK/pretrain.txt" || true
  "$PYTHON" - "$WORK/run/metrics.jsonl" >> "$LOG" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
steady = records[len(records) // 3:] or records  # after compile and warm-up
speed = statistics.median(r["images_per_s"] for r in steady)
wait = statistics.median(r["data_wait_s"] for r in steady)
worst = min(r["images_per_s"] for r in steady)
print(f"pretrain end to end (median, after warm-up)\t{speed:.0f}\t-\tdata wait {wait * 1000:.0f} ms/step, slowest step {worst:.0f} img/s")
PY
fi

if [[ -f "$ROOT/benchmarks/bench_build_masks.py" ]]; then
  echo "== bench_build_masks.py --device cuda"
  "$PYTHON" "$ROOT/benchmarks/bench_build_masks.py" --device cuda > "$WORK/masks.txt" 2>&1 \
    && tail -n 5 "$WORK/masks.txt" || tail -n 3 "$WORK/masks.txt"
fi

echo
echo "== figures ($(date -u +%Y-%m-%d), $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())'))"
column -t -s $'\t' -N "what,images/s,peak memory,step/bare encoder" "$LOG" 2>/dev/null || cat "$LOG"

#!/usr/bin/env bash
# Reproduce every GPU figure of the trainer and view pipeline on this machine's GPU, then print a table.
#
#   benchmarks/gpu.sh [WORK_DIR]        (default WORK_DIR: a new temporary folder)
#
# Needs a CUDA GPU, torch and (for the view pipeline) NVIDIA DALI. Environment knobs:
#   PYTHON (default python), BATCH (256), STEPS (20), THREADS (8 CPU threads for DALI), IMAGES (2000 demo
#   images for the end-to-end run and build-masks), SKIP_STEPS=1 / SKIP_VIEWS=1 / SKIP_PRETRAIN=1 /
#   SKIP_MASKS=1 to leave a part out (the figures of calls with the same WORK_DIR add up in its
#   figures.tsv, so parts can run in separate calls), SKIP_DOUBLE=1 to leave out the step rows at twice
#   the batch, MASK_SIZE (432, the saliency network's input), MASK_WORKERS (build-masks' worker processes;
#   default: the job's, the cores less one);
#   STEP_ARGS / VIEWS_ARGS / PRETRAIN_ARGS: extra arguments for bench_step.py, bench_views.py and
#   `relicv2 pretrain` (e.g. STEP_ARGS="--depth 18" PRETRAIN_ARGS="--set model.depth=18" on a small GPU);
#   DEVICE=cpu runs the same plumbing on the CPU (a check of the script, not a measurement).
# Figures: bench_step.py (eager, compiled, batch 2x with activation checkpointing), bench_colour.py (the torch
# colour stage, each view alone vs the views of one size as one batch), bench_views.py (DALI
# mixed vs the reference DataLoader, then a torch.profiler breakdown of a batch in views.txt and its trace
# in views-trace.json), `relicv2 pretrain` on a masked shard set (images/s and data wait per step from
# metrics.jsonl after warm-up, with batches made ahead and on demand, each as a ratio of the compiled
# step alone when that figure is in figures.tsv), and bench_build_masks.py (build-masks vs the bare
# network forward on the same images).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t relicv2-gpu-XXXXXX)}"
PYTHON="${PYTHON:-python}"
BATCH="${BATCH:-256}"
STEPS="${STEPS:-20}"
THREADS="${THREADS:-8}"
IMAGES="${IMAGES:-2000}"
DEVICE="${DEVICE:-cuda}"
read -r -a step_args <<< "${STEP_ARGS:-}"
read -r -a views_args <<< "${VIEWS_ARGS:-}"
read -r -a pretrain_args <<< "${PRETRAIN_ARGS:-}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"
LOG="$WORK/figures.tsv"  # kept across calls with the same WORK_DIR: parts run in separate calls add up
touch "$LOG"

device_name() {
  "$PYTHON" -c "import platform, torch; print(torch.cuda.get_device_name() if '$DEVICE' == 'cuda' else platform.processor() or 'CPU')"
}
if [[ "$DEVICE" == cuda ]]; then
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible: this script measures GPU figures (DEVICE=cpu checks the plumbing)')"
fi
echo "device: $(device_name) ($DEVICE); work folder $WORK"

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
  echo "== bench_step $name: $* ${STEP_ARGS:-}"
  if "$PYTHON" "$ROOT/benchmarks/bench_step.py" --device "$DEVICE" --bf16 --channels-last --steps "$STEPS" "$@" \
      "${step_args[@]}" > "$WORK/step-$name.txt" 2>&1; then
    cat "$WORK/step-$name.txt"; record "step $name" "$WORK/step-$name.txt"
  else
    tail -n 3 "$WORK/step-$name.txt"; printf 'step %s\tfailed (see %s)\t-\t-\n' "$name" "$WORK/step-$name.txt" >> "$LOG"
  fi
}

if [[ "${SKIP_STEPS:-0}" != 1 ]]; then
  step "batch $BATCH eager" --batch "$BATCH"
  step "batch $BATCH compiled" --batch "$BATCH" --compile
  if [[ "${SKIP_DOUBLE:-0}" != 1 ]]; then  # each compiles again (minutes on a machine with a cold cache)
    step "batch $((BATCH * 2)) compiled" --batch "$((BATCH * 2))" --compile
    step "batch $((BATCH * 2)) compiled+ckpt" --batch "$((BATCH * 2))" --compile --activation-checkpointing
  fi
fi

if [[ "${SKIP_VIEWS:-0}" != 1 ]]; then
  echo "== bench_colour: the torch colour stage, each view alone vs the views of one size together, batch $BATCH"
  if "$PYTHON" "$ROOT/benchmarks/bench_colour.py" --device "$DEVICE" --batch "$BATCH" > "$WORK/colour.txt" 2>&1; then
    cat "$WORK/colour.txt"
    "$PYTHON" - "$WORK/colour.txt" >> "$LOG" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
for label, name in (("each view alone", "alone"), ("views of one size together", "together"),
                    ("views of one size, fused", "fused")):
    _, computing, cpu_ms, wall_ms = re.search(rf"^{label} +(\d+) +(\d+) +([\d.]+) +([\d.]+)$", text, re.M).groups()
    print(f"colour stage {name} ({computing} kernels)\t-\t-\t{cpu_ms} CPU ms, {wall_ms} wall ms a batch")
PY
  else
    tail -n 3 "$WORK/colour.txt"; printf 'colour stage\tfailed (see %s)\t-\t-\n' "$WORK/colour.txt" >> "$LOG"
  fi
  echo "== bench_views: DALI mixed vs reference, batch $BATCH, $THREADS threads"
  # --profile: then where a batch's time goes (the loader's stages, the top operators), kept in views.txt
  if "$PYTHON" "$ROOT/benchmarks/bench_views.py" --device "$DEVICE" --batch "$BATCH" --threads "$THREADS" \
      --profile 4 --trace "$WORK/views-trace.json" "${views_args[@]}" > "$WORK/views.txt" 2>&1; then
    cat "$WORK/views.txt"
    "$PYTHON" - "$WORK/views.txt" >> "$LOG" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
ratios = dict(re.findall(r"^  ([a-z-]+): ([\d.]+x reference)", text, re.M))
for name, device, rate in re.findall(r"^([a-z-]+) +\(([a-z]+)\): +([\d.]+) images/s", text, re.M):
    print(f"views {name} ({device})\t{rate}\t-\t{ratios.get(name, '-')}")
PY
  else
    tail -n 3 "$WORK/views.txt"; printf 'views\tfailed (see %s)\t-\t-\n' "$WORK/views.txt" >> "$LOG"
  fi
fi

demo_images() {  # the demo images in WORK (made once, reused by the parts below)
  local per_class=$(( IMAGES / 6 ))
  [[ -d "$WORK/images" ]] || "$PYTHON" -m relicv2 demo-data "$WORK/images" --train-per-class "$per_class" \
      --val-per-class 2 --size 256 > /dev/null
}

demo_shards() {  # the demo images as a shard set (what build-masks reads)
  demo_images
  [[ -f "$WORK/shards/manifest.parquet" ]] || "$PYTHON" -m relicv2 shards build "$WORK/images/train" "$WORK/shards" \
      --workers "$THREADS" --no-progress > /dev/null
}

masked_shards() {  # the demo images with a mask each (bench_views.py's soft ellipses), as build-masks writes them
  demo_images
  [[ -f "$WORK/masked/manifest.parquet" ]] || "$PYTHON" - "$WORK/images/train" "$WORK/masked" <<'PY'
import sys
from pathlib import Path
from benchmarks.bench_views import build_masked_shards
from shards.images import header_problem

def readable(path):  # the demo data holds a few awkward files on purpose (for shards build's checks)
    with open(path, "rb") as file:
        return header_problem(file) is None

build_masked_shards([p for p in sorted(Path(sys.argv[1]).rglob("*.jpg")) if readable(p)], Path(sys.argv[2]))
PY
}

pretrain() {  # pretrain NAME ARGS...: one short `relicv2 pretrain`, its steady images/s and data wait as a row
  local name="$1"; shift
  echo "== relicv2 pretrain ($name) on $IMAGES masked demo images (imagenet-r50-1000ep preset: p_m 0.1, batch $BATCH, $DEVICE defaults) $* ${PRETRAIN_ARGS:-}"
  rm -rf "$WORK/run"
  "$PYTHON" -m relicv2 pretrain --config imagenet-r50-1000ep --output "$WORK/run" \
      --set data.train_shards="$WORK/masked" --set optim.global_batch="$BATCH" --set run.device="$DEVICE" \
      --set knn.train_shards= --set knn.val_shards= --set run.log_every=1 \
      --set run.max_steps=$(( 3 * IMAGES / BATCH )) --set run.checkpoint_every=100000 --set run.progress_bar=false \
      "$@" "${pretrain_args[@]}" > "$WORK/pretrain-$name.txt" 2>&1 || { tail -n 5 "$WORK/pretrain-$name.txt"; exit 1; }
  grep -E "torch.compile" "$WORK/pretrain-$name.txt" || true
  # End to end against the compiled step alone measured above (the trainer's default on CUDA).
  local row
  row=$("$PYTHON" - "$WORK/run/metrics.jsonl" "$LOG" "batch $BATCH compiled" "$name" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
steady = records[len(records) // 3:] or records  # after compile and warm-up
speed = statistics.median(r["images_per_s"] for r in steady)
wait = statistics.median(r["data_wait_s"] for r in steady)
worst = min(r["images_per_s"] for r in steady)
step_only = next((row.split("\t")[1] for row in open(sys.argv[2]) if row.startswith(f"step {sys.argv[3]}\t")), "-")
versus = f"{speed / float(step_only):.2f}x step only, " if step_only.replace(".", "").isdigit() else ""
print(f"pretrain end to end, {sys.argv[4]} (median, after warm-up)\t{speed:.0f}\t-\t{versus}data wait "
      f"{wait * 1000:.0f} ms/step, slowest step {worst:.0f} img/s")
PY
)
  echo "$row" >> "$LOG"
}

if [[ "${SKIP_PRETRAIN:-0}" != 1 ]]; then
  masked_shards
  pretrain "batches made ahead" --set views.ready_batches=1  # the default on a GPU
  pretrain "batches made on demand" --set views.ready_batches=0
fi

if [[ "${SKIP_MASKS:-0}" != 1 ]]; then
  echo "== bench_build_masks.py: saliency build-masks vs the bare forward, 432 px, batch 64"
  demo_shards
  if "$PYTHON" "$ROOT/benchmarks/bench_build_masks.py" --shards "$WORK/shards" --size "${MASK_SIZE:-432}" --batch 64 \
      ${MASK_WORKERS:+--workers "$MASK_WORKERS"} --device "$DEVICE" > "$WORK/masks.txt" 2>&1; then
    cat "$WORK/masks.txt"
    "$PYTHON" - "$WORK/masks.txt" >> "$LOG" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
job, ratio = re.search(r"build-masks: +([\d.]+) img/s", text), re.search(r"forward: ([\d.]+)", text)
forward = re.search(r"forward only: ([\d.]+) / ([\d.]+)", text)
steady = re.search(r"without the start .*, ratio ([\d.]+)", text)
own = re.search(r"own process: ([\d.]+) CPU ms per image, a ceiling of (\d+) img/s", text)
print(f"saliency build-masks\t{job.group(1)}\t-\t{ratio.group(1)}x the bare forward "
      f"({forward.group(1)} / {forward.group(2)} img/s before / after; {steady.group(1)}x without the workers' "
      f"start; job process {own.group(1)} CPU ms an image, a ceiling of {own.group(2)} img/s)")
PY
  else
    tail -n 3 "$WORK/masks.txt"; printf 'build-masks\tfailed (see %s)\t-\t-\n' "$WORK/masks.txt" >> "$LOG"
  fi
fi

echo
echo "== figures ($(date -u +%Y-%m-%d), $(device_name))"
column -t -s $'\t' -N "what,images/s,peak memory,step/bare encoder" "$LOG" 2>/dev/null || cat "$LOG"

#!/usr/bin/env bash
# The whole pipeline on CPU, on the built-in demo images or on your own, ending with an HTML report:
#   images -> shards -> handcrafted saliency -> saliency network (train) -> mask shards (build-masks)
#   -> ReLICv2 pretraining on the masked shards -> kNN and linear evaluation vs random init -> export
#   -> report.html
# Usage: scripts/demo.sh [python]            (`make demo`, `make demo DATA=/path/to/images`)
# Environment:
#   DEMO_OUT      output folder [demo-out]
#   DEMO_DATA     your images instead of the demo's: a folder with train/ and val/ (each with one
#                 sub-folder per class), a folder of class sub-folders (evaluated on its own images),
#                 or a flat folder (unlabelled: no evaluation)
#   DEMO_REDUCED  1: every stage shrunk to seconds (what the test suite runs)
#   DEMO_FRESH    1: start over instead of reusing the stages already done
# A second run reuses every finished stage (stamps in $DEMO_OUT/.done/) and resumes a stopped one.
set -euo pipefail

py=${1:-python}
if [[ "$py" == */* ]]; then py=$(realpath -s -m "$py"); fi
out=$(realpath -s -m "${DEMO_OUT:-demo-out}")
data=${DEMO_DATA:-}
if [[ -n "$data" ]]; then data=$(realpath -s -m "$data"); fi
reduced=${DEMO_REDUCED:-0}
cd "$(dirname "$0")/.."  # demo-out/ and the package are found from the repository root
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
start=$SECONDS

relicv2() { "$py" -m relicv2 "$@"; }

# Stage bookkeeping: a stage is done when its stamp holds the same settings it would run with now.
settings="data=${data:-builtin} reduced=$reduced"
if [[ "${DEMO_FRESH:-0}" == "1" || "$(cat "$out/.done/settings" 2>/dev/null)" != "$settings" ]]; then
  rm -rf "$out"
fi
mkdir -p "$out/.done"
echo "$settings" > "$out/.done/settings"
step=0
# stage NAME KEY TITLE: print the title; succeed (run it) unless NAME was done with the same KEY.
stage() {
  step=$((step + 1))
  if [[ -f "$out/.done/$1" && "$(cat "$out/.done/$1")" == "$2" ]]; then
    echo "== $step. $3: done in an earlier run, reused [+$((SECONDS - start)) s]"
    return 1
  fi
  echo "== $step. $3 [+$((SECONDS - start)) s]"
  return 0
}
finished() { echo "$2" > "$out/.done/$1"; }

if [[ "$reduced" == "1" ]]; then
  per_class=(--train-per-class 2 --val-per-class 1 --size 64); max_count=8; sample_images=2; view_size=32
  saliency_preset=tiny; saliency_sets=(--set num_images=4 --set epochs=1 --set fuse_epochs=1)
  pretrain_sets=(--set run.max_steps=3 --set optim.global_batch=8 --set loss.num_negatives=7 --set optim.epochs=2
                 --set optim.warmup_epochs=0 --set views.large_size=32 --set views.small_size=16
                 --set views.blur_kernel=3 --set model.hidden_dim=64 --set model.out_dim=32
                 --set knn.every_epochs=1 --set knn.crop_size=32 --set knn.resize_size=32 --set run.progress_bar=false)
else
  per_class=(); max_count=64; sample_images=8; view_size=64
  saliency_preset=demo; saliency_sets=()
  pretrain_sets=()
fi

# ---- 1. images
if [[ -z "$data" ]]; then
  train_images=$out/images/train; val_images=$out/images/val
  if stage images "${per_class[*]}" "demo images (photos bundled with scikit-image, no download)"; then
    relicv2 demo-data "$out/images" "${per_class[@]}"
    finished images "${per_class[*]}"
  fi
else
  [[ -d "$data" ]] || { echo "DEMO_DATA=$data is not a folder" >&2; exit 2; }
  if [[ -d "$data/train" && -d "$data/val" ]]; then
    train_images=$data/train; val_images=$data/val
  else
    train_images=$data; val_images=""
  fi
  echo "== using your images: train $train_images${val_images:+, val $val_images}"
fi

# ---- 2. shards
train=$out/shards/train; val=$out/shards/val
if stage shards "$max_count" "shards (odd files are converted or rejected: see rejected.parquet)"; then
  relicv2 shards build "$train_images" "$train" --max-count "$max_count" --workers 2 --no-progress
  relicv2 shards verify "$train"
  if [[ -n "$val_images" ]]; then
    relicv2 shards build "$val_images" "$val" --max-count "$max_count" --workers 2 --no-progress
    relicv2 shards verify "$val"
  fi
  finished shards "$max_count"
fi
labelled=$("$py" -c 'import json, sys; print(int(json.load(open(sys.argv[1])).get("labelled", 0) > 0))' "$train/info.json")
if [[ -z "$val_images" ]]; then
  val=$train
  if [[ "$labelled" == "1" ]]; then
    echo "   no val/ folder: evaluation uses the training images (an optimistic figure)"
  fi
fi

# ---- 3. handcrafted saliency on a few training images (the maps the report compares with the network)
maps=$out/saliency/maps
if stage handcrafted "$sample_images" "handcrafted saliency (RBD, MR, DSR, MC) on $sample_images training images"; then
  sample=$out/saliency/sample
  rm -rf "$sample" && mkdir -p "$sample"
  # Links named like the files, so the maps are named like the shard keys of the same images. The first
  # image of each folder (class) comes first, then the rest, so the report shows several classes (all
  # eight of the built-in demo's). (The list is read in full: `| head` would end `sort` with SIGPIPE,
  # which pipefail turns into a failure.)
  mapfile -t images < <(find -L "$train_images" -type f \( -iname '*.jpg' -o -iname '*.jpeg' \) -size +0 | LC_ALL=C sort \
      | awk '{ folder = $0; sub("/[^/]*$", "", folder); print (seen[folder]++ ? 1 : 0) "\t" $0 }' \
      | LC_ALL=C sort -s -t "$(printf '\t')" -k1,1n | cut -f2-)
  for image in "${images[@]:0:$sample_images}"; do ln -sf "$image" "$sample/"; done
  relicv2 saliency handcrafted --method all --input "$sample" --output "$maps" --workers 2 --no-progress
  finished handcrafted "$sample_images"
fi

# ---- 4. the saliency network trained on the handcrafted maps: the demo preset (no phase I; the reduced
# demo: tiny); one folder per preset, so a changed preset never meets another's state
# (the stamp holds the preset's checksum too: a changed preset trains again, and the masks follow)
network=$out/saliency/network-$saliency_preset
masked=$out/shards/masked-train-$saliency_preset
network_key="$saliency_preset $(sha256sum "saliency/presets/$saliency_preset.yaml" | cut -c1-12) ${saliency_sets[*]}"
if [[ "$(cat "$out/.done/saliency-input" 2>/dev/null)" != "$network_key" ]]; then
  rm -rf "$network" "$masked"  # another network's state and masks: start over (a stopped one resumes)
fi
if stage saliency-train "$network_key" "saliency network (saliency train --config $saliency_preset, random backbone)"; then
  echo "$network_key" > "$out/.done/saliency-input"
  relicv2 saliency train --shards "$train" --out "$network" --config "$saliency_preset" --backbone random \
      "${saliency_sets[@]}"
  finished saliency-train "$network_key"
fi

# ---- 5. mask shards: every training image with the network's mask
if stage build-masks "$max_count $network_key" "mask shards (saliency build-masks)"; then
  relicv2 saliency build-masks --model "$network/model.pt" --shards "$train" --out "$masked" --workers 2 --device cpu
  finished build-masks "$max_count $network_key"
fi
pretrain_shards=$masked; mask_probability=0.1  # the paper's p_m

# ---- 6. a look at the augmented views (4 large + 2 small per image), with and without masking
views=()
if stage views "$pretrain_shards $network_key" "augmented views of a few images"; then
  relicv2 pretrain preview-views --shards "$pretrain_shards" --output "$out/views-unmasked.png" --count 3 \
      --mask-probability 0 --large-size "$view_size" --small-size $((view_size / 2))
  if [[ "$pretrain_shards" == "$masked" ]]; then
    relicv2 pretrain preview-views --shards "$masked" --output "$out/views-masked.png" --count 3 \
        --mask-probability 1 --large-size "$view_size" --small-size $((view_size / 2))
  fi
  finished views "$pretrain_shards $network_key"
fi
for png in "$out/views-masked.png" "$out/views-unmasked.png"; do
  if [[ -f "$png" ]]; then views+=(--views "$png"); fi
done

# ---- 7. ReLICv2 pretraining (ResNet-18) with a kNN monitor
run=$out/run
knn_sets=()
if [[ "$labelled" == "1" ]]; then
  knn_sets=(--set knn.train_shards="$train" --set knn.val_shards="$val")
else
  knn_sets=(--set knn.train_shards= --set knn.val_shards=)
fi
key="$pretrain_shards p_m=$mask_probability $network_key"
if [[ "$(cat "$out/.done/pretrain-input" 2>/dev/null)" != "$key" ]]; then
  rm -rf "$run"  # other input shards than the run in the folder (e.g. masks became available): start over
fi
if stage pretrain "$key" "ReLICv2 pretraining on $(basename "$pretrain_shards") (p_m $mask_probability)"; then
  echo "$key" > "$out/.done/pretrain-input"
  relicv2 pretrain --config demo-cpu --output "$run" --set data.train_shards="$pretrain_shards" \
      --set views.mask_probability="$mask_probability" "${knn_sets[@]}" "${pretrain_sets[@]}"
  finished pretrain "$key"
fi

# ---- 8. evaluation of the final checkpoint vs a random-init encoder, each written as JSON
evals=$out/eval
mkdir -p "$evals"
if [[ "$labelled" != "1" ]]; then
  step=$((step + 1)); echo "== $step. evaluation: skipped, the images have no class labels"
elif stage eval "$key" "kNN and linear (fast) evaluation vs random init"; then
  crop=(--crop-size "$view_size" --resize-size "$view_size" --device cpu)
  relicv2 eval knn --checkpoint "$run" --train "$train" --val "$val" "${crop[@]}" --json "$evals/knn.json"
  relicv2 eval knn --random-init 18 --train "$train" --val "$val" "${crop[@]}" --json "$evals/knn-random.json"
  sizes=(--set crop_size="$view_size" --set resize_size="$view_size")  # one protocol for both figures
  relicv2 eval linear --checkpoint "$run" --train "$train" --val "$val" --config fast "${sizes[@]}" \
      --output "$evals/linear" --json "$evals/linear-fast.json"
  relicv2 eval linear --random-init 18 --train "$train" --val "$val" --config fast "${sizes[@]}" \
      --output "$evals/linear-random" --json "$evals/linear-fast-random.json"
  finished eval "$key"
fi

# ---- 9. export the encoder as a plain (torchvision-format) state dict
export_file=$out/export/resnet18.pt
if stage export "$key" "export the encoder (torchvision format)"; then
  mkdir -p "$(dirname "$export_file")"
  relicv2 export --checkpoint "$run" --out "$export_file"
  finished export "$key"
fi

# ---- 10. the report (always rebuilt: it only reads the files above)
step=$((step + 1)); echo "== $step. report"
report_shards=$masked
relicv2 report --out "$out/report.html" --run "$run" --eval "$evals" --saliency-report "$network/report.json" \
    --maps "$maps" --shards "$report_shards" "${views[@]}" --count "$sample_images" \
    --title "relicv2 demo$([[ "$reduced" == "1" ]] && echo " (reduced)")"

cat <<EOF

demo finished in $((SECONDS - start)) s; everything is under $out/
  report         $out/report.html  (open it in a browser; figures in $out/report-figures/)
  shards         $train${val_images:+, $val}, $masked
  saliency       maps in $maps/<method>/, network in $network/
  views          $out/views-*.png
  pretraining    $run/ (checkpoint-*.pt, metrics.jsonl, tensorboard/, config.yaml)
  evaluation     $evals/*.json
  export         $([[ -f "$export_file" ]] && echo "$export_file" || echo "not run")
Run it again to reuse what is done; DEMO_FRESH=1 starts over.
EOF

#!/usr/bin/env bash
# make demo: every part of the system on built-in synthetic data, on a CPU (or a GPU when there is one).
# Each step is a real command of the repository and resumes if re-run. Sizes can be lowered through the
# environment (the test suite runs smaller versions):
#   DEMO_OUT            output folder (runs/demo)
#   DEMO_SIZE           image side in pixels, a multiple of 16 (64)
#   DEMO_COUNT          training images (4000); DEMO_N: samples per prompt (8)
#   DEMO_VAE_STEPS      VAE steps (900); DEMO_VAE_FLAGS: extra train_vae.py flags
#   DEMO_TRAIN_FLAGS    extra SD_Train.py flags of the UNet run; DEMO_NPROC: its ranks
#   DEMO_THREADS        CPU threads of each step but the trainer, which gives each rank cpu_count / ranks
#   DEMO_CONCEPT=0      leaves out the new-concept steps (8 and 9); DEMO_CONCEPT_COUNT: its instance images
#                       (12); DEMO_CONCEPT_FLAGS: extra SD_Train.py flags of its runs; DEMO_CONCEPT_RUNS:
#                       which ones (prior no_prior embedding pivotal: the LoRAs, the learned token, both)
#   DEMO_POSTHOC=0      leaves out the post-hoc EMA step (7); DEMO_POSTHOC_LENGTHS: its lengths (0.05,0.10,0.20)
#   DEMO_LCM=0          leaves out the few-step step (11); DEMO_LCM_FLAGS: extra SD_Train.py flags of its run
#   DEMO_FLOW=0         leaves out the flow-matching step (12); DEMO_FLOW_FLAGS: extra SD_Train.py flags of its
#                       two runs; DEMO_REFLOW_PAIRS: the reflow pairs drawn (2048)
#   DEMO_DMD_STEPS      the DMD generators of step 11, by their steps (1; "1 4" for both; 0: none);
#                       DEMO_DMD_FLAGS: extra SD_Train.py flags of their runs
#   DEMO_CONTROL=0      leaves out the ControlNet step (13); DEMO_CONTROL_COUNT: its training images (2000);
#                       DEMO_CONTROL_FLAGS: extra SD_Train.py flags of its run
#   DEMO_DPO=0          leaves out the preference-tuning step (14); DEMO_DPO_REPEATS: draw lines per prompt of its
#                       pairs half (24), each drawn DEMO_DPO_K times (4); DEMO_DPO_FLAGS: extra SD_Train.py flags
#   DEMO_ASPECT=0       leaves out the aspect-ratio step; DEMO_ASPECT_COUNT: its wide, tall and square
#                       images (600); DEMO_ASPECT_FLAGS: extra SD_Train.py flags of its two runs;
#                       DEMO_ASPECT_RUNS: which models it samples (base buckets square); DEMO_WIDE: its wide
#                       bucket and samples, WxH (144x48; the tall ones are the same turned)
# Every step is seeded (data, VAE, UNet, sampler: seed 0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${DEMO_OUT:-runs/demo}
COUNT=${DEMO_COUNT:-4000}
VAE_STEPS=${DEMO_VAE_STEPS:-900}
SIZE=${DEMO_SIZE:-64}
WIDE=${DEMO_WIDE:-144x48}
TALL=${WIDE#*x}x${WIDE%x*}
N=${DEMO_N:-8}
# One rank per GPU (NCCL); two gloo ranks on a CPU, to show DDP there too.
NPROC=${DEMO_NPROC:-$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)")}
export NO_ALBUMENTATIONS_UPDATE=1 WANDB_MODE=${WANDB_MODE:-disabled} HF_HUB_OFFLINE=1
if [ -n "${DEMO_THREADS:-}" ]; then export OMP_NUM_THREADS=$DEMO_THREADS MKL_NUM_THREADS=$DEMO_THREADS; fi
start=$(date +%s)
step() { printf '\n=== [%ss] %s ===\n' "$(( $(date +%s) - start ))" "$*"; }
run_dir() { case $1 in embedding|pivotal) echo "$1" ;; *) echo "lora_$1" ;; esac; }  # a concept run's folder
# sample_row FOLDER ROW SD_ImageGen.py's model and sampler flags: a table row's samples of every demo prompt
# (FOLDER/samples_ROW) and demo/evaluate.py's scores of them (FOLDER/eval_ROW.json)
sample_row() {
  local folder=$1 row=$2
  shift 2
  rm -rf "$folder/samples_$row"
  $PY SD_ImageGen.py "$@" --prompts_file "$OUT/shards/prompts.txt" --n "$N" --seed 0 --height "$SIZE" \
      --width "$SIZE" --batch_size 16 --out "$folder/samples_$row"
  $PY demo/evaluate.py --images "$folder/samples_$row" --prompts "$OUT/shards/demo_prompts.json" \
      --out "$folder/eval_$row.json"
}

step "1/15 synthetic captioned images (pipeline/00_make_demo_data.py)"
$PY pipeline/00_make_demo_data.py --out "$OUT/shards" --count "$COUNT" --size "$SIZE" --vae_count $((COUNT / 3)) \
    --vae_out "$OUT/vae_shards"

step "2/15 a VAE for these images and the same shapes in cyan, a colour the UNet never sees (train_vae.py)"
if [ -f "$OUT/vae/config.json" ]; then echo "$OUT/vae exists"; else
  $PY train_vae.py --shards "$OUT/*shards/*.tar" --out "$OUT/vae" --resolution "$SIZE" --max_steps "$VAE_STEPS" \
      --seed 0 ${DEMO_VAE_FLAGS:-}
fi

step "3/15 latents, token ids, training dataset (encode_latents.py, stages 04 and 05)"
$PY encode_latents.py --shards "$OUT/shards/*.tar" --out "$OUT/latents" --vae "$OUT/vae" --resolution "$SIZE" \
    --batch_size 64 --workers 2
$PY pipeline/04_preprocess_to_cache.py --shards "$OUT/shards/*.tar" --out "$OUT/captions" --tokenizer tiny
$PY pipeline/05_build_hf_dataset.py --captions "$OUT/captions" --latents "$OUT/latents" --out "$OUT/dataset" \
    --val_fraction 0.03

step "4/15 the UNet, $NPROC ranks (torchrun SD_Train.py --config configs/demo.yaml)"
# shellcheck disable=SC2086  # DEMO_TRAIN_FLAGS is a list of flags
$PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" SD_Train.py --config configs/demo.yaml \
    --datasets "[{dataset: $OUT/dataset, latents: $OUT/latents}]" --vae "$OUT/vae" --out_dir "$OUT/train" \
    ${DEMO_TRAIN_FLAGS:-}

step "5/15 samples of seen and held-out prompts with the EMA weights (SD_ImageGen.py)"
rm -rf "$OUT/samples"
$PY SD_ImageGen.py --ckpt "$OUT/train" --prompts_file "$OUT/shards/prompts.txt" --n "$N" --steps 25 --cfg 3.5 \
    --seed 0 --height "$SIZE" --width "$SIZE" --batch_size 16 --out "$OUT/samples"

step "6/15 prompt adherence (demo/evaluate.py) and FID against fresh ground-truth drawings (demo/fid.py, SD_Eval.py)"
$PY demo/evaluate.py --images "$OUT/samples" --prompts "$OUT/shards/demo_prompts.json" --out "$OUT/eval.json"
$PY demo/fid.py --samples "$OUT/samples" --prompts "$OUT/shards/demo_prompts.json" --out "$OUT/fid"

step "7/15 post-hoc EMA: EMAs of three lengths rebuilt after training from the run's snapshots, their FID beside the classic EMA's (SD_ImageGen.py --ema_length, demo/posthoc.py)"
LENGTHS=${DEMO_POSTHOC_LENGTHS:-0.05,0.10,0.20}
if [ "${DEMO_POSTHOC:-1}" = 0 ]; then echo "left out (DEMO_POSTHOC=0)"; else
  for length in ${LENGTHS//,/ }; do
    rm -rf "$OUT/posthoc/$length/samples"
    $PY SD_ImageGen.py --ckpt "$OUT/train" --ema_length "$length" --prompts_file "$OUT/shards/prompts.txt" --n "$N" \
        --steps 25 --cfg 3.5 --seed 0 --height "$SIZE" --width "$SIZE" --batch_size 16 --out "$OUT/posthoc/$length/samples"
    $PY demo/fid.py --samples "$OUT/posthoc/$length/samples" --prompts "$OUT/shards/demo_prompts.json" \
        --out "$OUT/posthoc/$length/fid"
  done
  $PY demo/posthoc.py --out "$OUT" --lengths "$LENGTHS"
fi

step "8/15 a new concept, cyan: a DreamBooth LoRA ('a sks circle') with and without prior preservation, a learned token ('a <cyan-sks> circle'), and both together (pivotal tuning)"
CONCEPT=$OUT/concept
if [ "${DEMO_CONCEPT:-1}" = 0 ]; then echo "left out (DEMO_CONCEPT=0)"; else
  $PY demo/concept.py images --prompts "$OUT/shards/demo_prompts.json" --out "$CONCEPT" --vae "$OUT/vae" \
      --count "${DEMO_CONCEPT_COUNT:-12}" --size "$SIZE"
  for run in ${DEMO_CONCEPT_RUNS:-prior no_prior embedding pivotal}; do
    case $run in
      prior) recipe=(--config configs/demo_dreambooth.yaml --subject.class_dir "$CONCEPT/class") ;;
      no_prior) recipe=(--config configs/demo_dreambooth.yaml --subject.class_dir "" --subject.class_prompt "") ;;
      embedding) recipe=(--config configs/demo_embedding.yaml) ;;
      pivotal) recipe=(--config configs/demo_pivotal.yaml --subject.class_dir "$CONCEPT/class") ;;
    esac
    # shellcheck disable=SC2086  # DEMO_CONCEPT_FLAGS is a list of flags
    $PY SD_Train.py "${recipe[@]}" --init_from "$OUT/train" --vae "$OUT/vae" --subject.instance_dir "$CONCEPT/instance" \
        --out_dir "$CONCEPT/$(run_dir "$run")" --subject.image_size "$SIZE" ${DEMO_CONCEPT_FLAGS:-}
  done
  if [ -d "$CONCEPT/embedding" ]; then  # the token as a file AUTOMATIC1111 and ComfyUI load
    $PY SD_ImageGen.py --ckpt "$CONCEPT/embedding" --export_embedding "$CONCEPT/embeddings"
  fi
  if [ -d "$CONCEPT/pivotal" ]; then  # the LoRA with its token bundled, and the token's own file beside it
    $PY SD_ImageGen.py --ckpt "$CONCEPT/pivotal" --export_lora "$CONCEPT/pivotal_lora/cyan.safetensors"
  fi

  step "9/15 the seen prompts and the concept, sampled before and after (SD_ImageGen.py, demo/evaluate.py)"
  for run in base ${DEMO_CONCEPT_RUNS:-prior no_prior embedding pivotal}; do
    if [ "$run" = base ]; then ckpt=$OUT/train; else ckpt=$CONCEPT/$(run_dir "$run"); fi
    prompts=$CONCEPT/prompts.txt
    if [ "$run" = embedding ] || [ "$run" = pivotal ]; then prompts=$CONCEPT/prompts_embedding.txt; fi
    rm -rf "$CONCEPT/samples_$run"
    $PY SD_ImageGen.py --ckpt "$ckpt" --prompts_file "$prompts" --n "$N" --steps 25 --cfg 3.5 --seed 0 \
        --height "$SIZE" --width "$SIZE" --batch_size 16 --out "$CONCEPT/samples_$run"
    $PY demo/evaluate.py --images "$CONCEPT/samples_$run" --prompts "$CONCEPT/concept_prompts.json" \
        --out "$CONCEPT/eval_$run.json"
  done
  $PY demo/concept.py report --out "$CONCEPT"
fi

step "10/15 aspect-ratio buckets: wide and tall images with the shape at one end, trained in buckets and as centre squares"
ASPECT=$OUT/aspect
if [ "${DEMO_ASPECT:-1}" = 0 ]; then echo "left out (DEMO_ASPECT=0)"; else
  $PY demo/aspect.py images --prompts "$OUT/shards/demo_prompts.json" --out "$ASPECT" --count "${DEMO_ASPECT_COUNT:-600}"
  $PY pipeline/04_preprocess_to_cache.py --shards "$ASPECT/shards/*.tar" --out "$ASPECT/captions" --tokenizer tiny
  for kind in buckets square; do
    if [ "$kind" = buckets ]; then fit=(--bucket_list "${SIZE}x$SIZE,$WIDE,$TALL"); else fit=(); fi
    $PY encode_latents.py --shards "$ASPECT/shards/*.tar" --out "$ASPECT/latents_$kind" --vae "$OUT/vae" --resolution "$SIZE" \
        "${fit[@]}" --batch_size 64 --workers 2
    $PY pipeline/05_build_hf_dataset.py --captions "$ASPECT/captions" --latents "$ASPECT/latents_$kind" \
        --out "$ASPECT/dataset_$kind" --val_fraction 0
    # shellcheck disable=SC2086  # DEMO_ASPECT_FLAGS is a list of flags
    $PY SD_Train.py --config configs/demo_aspect.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
        --datasets "[{dataset: $ASPECT/dataset_$kind, latents: $ASPECT/latents_$kind}]" --out_dir "$ASPECT/train_$kind" \
        ${DEMO_ASPECT_FLAGS:-}
  done
  for run in ${DEMO_ASPECT_RUNS:-base buckets square}; do
    if [ "$run" = base ]; then ckpt=$OUT/train; else ckpt=$ASPECT/train_$run; fi
    for size in "wide:$WIDE" "tall:$TALL"; do
      width=${size#*:}; width=${width%x*}; height=${size#*x}
      rm -rf "$ASPECT/samples_${run}_${size%%:*}"
      $PY SD_ImageGen.py --ckpt "$ckpt" --prompts_file "$ASPECT/prompts.txt" --n "$N" --steps 25 --cfg 3.5 --seed 0 \
          --width "$width" --height "$height" --batch_size 16 --out "$ASPECT/samples_${run}_${size%%:*}"
    done
  done
  $PY demo/aspect.py report --out "$ASPECT" --prompts "$OUT/shards/demo_prompts.json"
fi

step "11/15 few-step sampling: the UNet distilled into a latent consistency model (SD_Train.py --config configs/demo_lcm.yaml), sampled in 2, 4 and 8 steps beside DDIM in 50, 4, 2 and 1, and into a one-step DMD generator (configs/demo_dmd.yaml)"
LCM=$OUT/lcm_eval
if [ "${DEMO_LCM:-1}" = 0 ]; then echo "left out (DEMO_LCM=0)"; else
  rows="ddim_50 ddim_4 ddim_2 ddim_1 lcm_2 lcm_4 lcm_8"
  mkdir -p "$LCM"
  began=$(date +%s)
  # shellcheck disable=SC2086  # DEMO_LCM_FLAGS is a list of flags
  $PY SD_Train.py --config configs/demo_lcm.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
      --datasets "[{dataset: $OUT/dataset, latents: $OUT/latents}]" --out_dir "$OUT/lcm" ${DEMO_LCM_FLAGS:-}
  cost="{\"lcm\": $(( $(date +%s) - began ))"
  for generator in ${DEMO_DMD_STEPS:-1}; do  # DEMO_DMD_STEPS=0: no DMD generator
    [ "$generator" = 0 ] && break
    began=$(date +%s)
    # shellcheck disable=SC2086  # DEMO_DMD_FLAGS is a list of flags
    $PY SD_Train.py --config configs/demo_dmd.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
        --datasets "[{dataset: $OUT/dataset, latents: $OUT/latents}]" --out_dir "$OUT/dmd_$generator" \
        --dmd.steps "$generator" --validation.steps "$generator" ${DEMO_DMD_FLAGS:-}
    cost="$cost, \"dmd_$generator\": $(( $(date +%s) - began ))"
    rows="$rows dmd_$generator"
  done
  echo "$cost}" > "$LCM/training_seconds.json"  # each distillation's minutes, for demo/lcm.py's table
  for row in $rows; do
    case $row in
      ddim_*) sampling=(--ckpt "$OUT/train" --sampler ddim --steps "${row#ddim_}" --cfg 3.5) ;;
      lcm_*) sampling=(--ckpt "$OUT/lcm" --sampler lcm --steps "${row#lcm_}" --cfg 1) ;;
      dmd_*) sampling=(--ckpt "$OUT/$row" --sampler onestep --cfg 1) ;;
    esac
    sample_row "$LCM" "$row" "${sampling[@]}"
  done
  $PY demo/lcm.py --out "$LCM" --reference "$OUT/fid/reference"
fi

step "12/15 flow matching: the demo model fine-tuned to a rectified flow (configs/demo_flow.yaml), sampled in 25, 8 and 4 Euler steps; reflowed on 2048 pairs of its own ODE (SD_Reflow.py, configs/demo_reflow.yaml) and sampled in 2 and 1"
FLOW=$OUT/flow
if [ "${DEMO_FLOW:-1}" = 0 ]; then echo "left out (DEMO_FLOW=0)"; else
  # shellcheck disable=SC2086  # DEMO_FLOW_FLAGS is a list of flags
  $PY SD_Train.py --config configs/demo_flow.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
      --datasets "[{dataset: $OUT/dataset, latents: $OUT/latents}]" --out_dir "$FLOW/train" ${DEMO_FLOW_FLAGS:-}
  $PY -c "import json, sys; print('\n'.join(json.load(open(sys.argv[1]))['seen']))" "$OUT/shards/demo_prompts.json" \
      > "$FLOW/seen_prompts.txt"  # the pairs' prompts: the training captions, never the held-out ones
  $PY SD_Reflow.py --ckpt "$FLOW/train" --prompts "$FLOW/seen_prompts.txt" --out "$FLOW/pairs" \
      --n "${DEMO_REFLOW_PAIRS:-2048}" --steps 25 --cfg 3.5 --shard_size 512 --batch_size 64
  $PY pipeline/05_build_hf_dataset.py --captions "$FLOW/pairs/captions" --latents "$FLOW/pairs/latents" \
      --out "$FLOW/pairs/dataset" --val_fraction 0
  # shellcheck disable=SC2086  # DEMO_FLOW_FLAGS is a list of flags
  $PY SD_Train.py --config configs/demo_reflow.yaml --init_from "$FLOW/train" --vae "$OUT/vae" \
      --datasets "[{dataset: $FLOW/pairs/dataset, latents: $FLOW/pairs/latents}]" --out_dir "$FLOW/reflow" \
      ${DEMO_FLOW_FLAGS:-}
  for row in ddim_50 ddim_4 flow_25 flow_8 flow_4 reflow_2 reflow_1; do
    case $row in
      ddim_*) sampling=(--ckpt "$OUT/train" --sampler ddim --steps "${row#ddim_}" --cfg 3.5) ;;
      flow_*) sampling=(--ckpt "$FLOW/train" --sampler flow_euler --steps "${row#flow_}" --cfg 3.5) ;;
      reflow_*) sampling=(--ckpt "$FLOW/reflow" --sampler flow_euler --steps "${row#reflow_}" --cfg 1) ;;
    esac
    sample_row "$FLOW" "$row" "${sampling[@]}"
  done
  $PY demo/flow.py --out "$FLOW" --lcm "$LCM" --reference "$OUT/fid/reference"
fi

step "13/15 spatial control: a ControlNet on the frozen demo model draws the shape where a silhouette says (SD_Train.py --config configs/demo_control.yaml)"
CONTROL=$OUT/control
if [ "${DEMO_CONTROL:-1}" = 0 ]; then echo "left out (DEMO_CONTROL=0)"; else
  $PY demo/control.py images --prompts "$OUT/shards/demo_prompts.json" --out "$CONTROL" --size "$SIZE" \
      --count "${DEMO_CONTROL_COUNT:-2000}"
  $PY encode_latents.py --shards "$CONTROL/shards/*.tar" --out "$CONTROL/latents" --vae "$OUT/vae" --resolution "$SIZE" \
      --control seg --batch_size 64 --workers 2
  $PY pipeline/04_preprocess_to_cache.py --shards "$CONTROL/shards/*.tar" --out "$CONTROL/captions" --tokenizer tiny
  $PY pipeline/05_build_hf_dataset.py --captions "$CONTROL/captions" --latents "$CONTROL/latents" \
      --out "$CONTROL/dataset" --val_fraction 0
  # shellcheck disable=SC2086  # DEMO_CONTROL_FLAGS is a list of flags
  $PY SD_Train.py --config configs/demo_control.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
      --datasets "[{dataset: $CONTROL/dataset, latents: $CONTROL/latents}]" --out_dir "$CONTROL/train" \
      ${DEMO_CONTROL_FLAGS:-}
  controls=()
  while IFS= read -r mask; do controls+=(--control "$mask"); done < "$CONTROL/controls.txt"
  rm -rf "$CONTROL/samples_control" "$CONTROL/samples_base"
  $PY SD_ImageGen.py --ckpt "$CONTROL/train" --prompts_file "$CONTROL/prompts.txt" "${controls[@]}" --n "$N" --steps 25 \
      --cfg 3.5 --seed 0 --batch_size 16 --out "$CONTROL/samples_control"
  $PY SD_ImageGen.py --ckpt "$OUT/train" --prompts_file "$CONTROL/prompts.txt" --n "$N" --steps 25 --cfg 3.5 --seed 0 \
      --height "$SIZE" --width "$SIZE" --batch_size 16 --out "$CONTROL/samples_base"
  $PY SD_ImageGen.py --ckpt "$CONTROL/train" --export_controlnet "$CONTROL/controlnet_seg.safetensors"
  $PY demo/control.py report --prompts "$OUT/shards/demo_prompts.json" --out "$CONTROL"
fi

step "14/15 preference tuning: Diffusion-DPO of the demo model on pairs of its own drawings for half of the prompts, ranked by the colour-and-shape oracle (pipeline/01g_draw_pairs.py, SD_Train.py --config configs/demo_dpo.yaml), scored on both halves"
DPO=$OUT/dpo
if [ "${DEMO_DPO:-1}" = 0 ]; then echo "left out (DEMO_DPO=0)"; else
  $PY demo/preference.py halves --prompts "$OUT/shards/demo_prompts.json" --out "$DPO" --repeats "${DEMO_DPO_REPEATS:-24}"
  began=$(date +%s)
  $PY pipeline/01g_draw_pairs.py --model "$OUT/train" --prompts "$DPO/draw_prompts.txt" --out "$DPO/draw" \
      --per_prompt "${DEMO_DPO_K:-4}" --scorer demo.evaluate:preference_score --steps 25 --cfg 3.5 --seed 0 \
      --width "$SIZE" --height "$SIZE" --batch_size 64
  drawn=$(date +%s)
  $PY encode_latents.py --shards "$DPO/draw/shards/*.tar" --out "$DPO/latents" --vae "$OUT/vae" --resolution "$SIZE" \
      --pairs --batch_size 64 --workers 2
  $PY pipeline/04_preprocess_to_cache.py --shards "$DPO/draw/shards/*.tar" --out "$DPO/captions" --tokenizer tiny
  $PY pipeline/05_build_hf_dataset.py --captions "$DPO/captions" --latents "$DPO/latents" --out "$DPO/dataset" \
      --val_fraction 0
  # shellcheck disable=SC2086  # DEMO_DPO_FLAGS is a list of flags
  $PY SD_Train.py --config configs/demo_dpo.yaml --init_from "$OUT/train" --vae "$OUT/vae" \
      --datasets "[{dataset: $DPO/dataset, latents: $DPO/latents}]" --out_dir "$DPO/train" ${DEMO_DPO_FLAGS:-}
  trained=$(date +%s)
  $PY demo/preference.py cost --out "$DPO" --draw_s $((drawn - began)) --train_s $((trained - drawn))
  for half in pairs unseen; do
    for model in base dpo; do
      if [ "$model" = base ]; then ckpt=$OUT/train; else ckpt=$DPO/train; fi
      rm -rf "$DPO/samples_${model}_$half"
      $PY SD_ImageGen.py --ckpt "$ckpt" --prompts_file "$DPO/prompts_$half.txt" --n "$N" --steps 25 --cfg 3.5 --seed 0 \
          --height "$SIZE" --width "$SIZE" --batch_size 16 --out "$DPO/samples_${model}_$half"
      $PY demo/evaluate.py --images "$DPO/samples_${model}_$half" --prompts "$DPO/halves.json" \
          --out "$DPO/eval_${model}_$half.json"
    done
    $PY demo/fid.py --samples "$DPO/samples_base_$half" --prompts "$DPO/halves.json" --out "$DPO/fid_$half"
  done
  $PY demo/preference.py report --out "$DPO"
fi

step "15/15 done"
cat <<SUMMARY
  sample grid        $OUT/samples/grid.png (rows: the seen prompts, then the held-out ones)
  loss curve         $OUT/train/loss.png
  metrics            $OUT/train/metrics.jsonl
  checkpoints        $OUT/train/checkpoints/
  post-hoc EMA       $OUT/posthoc.json (FID of each rebuilt EMA length and the classic EMA)
  validation grids   $OUT/train/samples/
  VAE                $OUT/vae (vae_stats.json: held-out PSNR)
  accuracy           $OUT/eval.json
  FID                $OUT/fid/fid.json (offline stand-in features: demo model, ground-truth floor, blank canvas)
  new concept        $CONCEPT/concept.json ($CONCEPT/samples_*/grid.png: base, LoRA with and without prior
                     preservation, learned token, pivotal tuning; the token's file for other tools:
                     $CONCEPT/embeddings/; the pivotal LoRA with its token: $CONCEPT/pivotal_lora/)
  few-step sampling  $LCM/lcm.json ($LCM/samples_*/grid.png: DDIM 50, 4 and 2 steps, LCM 2, 4 and 8)
  flow matching      $FLOW/flow.json ($FLOW/samples_*/grid.png: DDIM 50 and 4, the flow model's Euler 25, 8 and 4,
                     the reflowed model's 2 and 1; LCM's 2 and 4 beside them when step 11 ran)
  spatial control    $CONTROL/control.json ($CONTROL/control.png: masks, ControlNet and demo-model samples; the
                     ControlNet for ComfyUI and AUTOMATIC1111: $CONTROL/controlnet_seg.safetensors)
  preference tuning  $DPO/preference.json ($DPO/samples_base|dpo_pairs|unseen/grid.png: the demo model and its DPO
                     tuning on the prompts pairs were drawn for and on those never in a pair)
  aspect buckets     $ASPECT/aspect.json ($ASPECT/samples_*_wide|tall/grid.png: base, buckets, centre squares)
SUMMARY

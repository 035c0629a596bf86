#!/usr/bin/env bash
# The GPU benchmark table in one command, within 30 minutes, into one dated Markdown file.
#
#   bash bench/gpu_suite.sh                        # on a CUDA machine: every GPU it sees
#   bash bench/gpu_suite.sh --peer_script PATH/train_text_to_image.py --out FILE.md
#   bash bench/gpu_suite.sh --smoke --out FILE.md  # every piece at the tiniest size on the CPU (a few minutes)
#
# Runs, each under its own timeout and all within --budget seconds (default 1740): the training step's
# images/s and MFU at 512 and 256 px for batch 8, 16, 32 and the batch `batch_size: auto` picks, eager
# (bench/train_throughput.py), and compiled at 512 px for batch 16 and auto, then batch 16 in compile
# modes reduce-overhead (CUDA graphs) and max-autotune-no-cudagraphs; DDP on all GPUs against one
# (bench/ddp_step.py, with 2 or more GPUs); ours against diffusers' train_text_to_image.py step on the
# same GPU and batch (its script end to end too with --peer_script or DIFFUSERS_TRAIN_SCRIPT); the measured peak memory against sd.train.memory's
# estimate (bench/lora_step.py --ema) and the SD 1.x predictions (bench/memory_estimate.py); sampling
# (bench/sampling.py); latent encoding (bench/encode_throughput.py); `pytest -m gpu`; then the other
# compiled steps, one batch at a time (about two minutes of compiling each), as long as the budget lasts. A
# piece that times out or fails is marked so and the suite goes on. Writes
# bench/results/gpu_suite_<date>_<gpu>.md (or --out): a summary table, then per piece its command, how
# it ended, Markdown tables of its JSON result and its printed tables. The file appears when the suite
# ends (its sections collect in FILE.partial.md until then). PYTHON names the interpreter (default python).
# With --smoke the Python pieces run in children forked from one interpreter that imported torch, diffusers
# and transformers once (bench/preload.py): at that size the imports are most of a piece's time.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
SMOKE=0
OUT=""
PEER_SCRIPT="${DIFFUSERS_TRAIN_SCRIPT:-}"
BUDGET=1740

usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --out) OUT="$2"; shift ;;
        --peer_script) PEER_SCRIPT="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

GPUS=0  # the GPUs this process may use (CUDA_VISIBLE_DEVICES counts; nvidia-smi -L lists them all)
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || nvidia-smi -L | grep -c '^GPU')
fi
if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu GPU_NAME="cpu-smoke" ARCH=tiny RESOLUTIONS="64" BATCHES="2" AUTO_ARGS="--gpu_gb 0.6 --limit 4"
    PEER_BATCH=2 COMPILE_FIRST="" COMPILE_LATER="" DDP_RANKS=2 PRECISION=fp32
    STEPS="--warmup 1 --timed_steps 1 --rounds 1"
    DDP_ARGS="--batch 2 --warmup 1 --timed_steps 1 --rounds 1"
    MEM_ARGS="--resolution 64 --batch_sizes 2 --warmup 1 --timed_steps 1 --peer false --estimate false"
    ESTIMATE_ARGS="--grid tiny:64:2:0 --sd1 false"
    SAMPLING_ARGS="--resolution 64 --batch_sizes 1 --steps 2 --repeats 1 --modes eager"
    ENCODE_ARGS="--vae tiny --resolution 64 --images 16 --per_shard 8 --batch_size 8 --workers 2"
else
    if [ "$GPUS" -lt 1 ]; then
        echo "gpu_suite.sh: no CUDA GPU (nvidia-smi lists none); run with --smoke to test the script on the CPU" >&2
        exit 2
    fi
    DEVICE=cuda ARCH=sd1 RESOLUTIONS="512 256" BATCHES="8 16 32" AUTO_ARGS="" PRECISION=bf16
    GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9\n' '_' | tr -d '\n')
    PEER_BATCH=16 DDP_RANKS=$GPUS
    COMPILE_FIRST="512:16 512:auto"  # then the rest, while the budget lasts
    COMPILE_LATER="512:8 512:32 256:8 256:16 256:32 256:auto"
    STEPS="--warmup 3 --timed_steps 10 --rounds 1"
    DDP_ARGS="--arch sd1 --resolution 512 --batch 16 --precision bf16"
    MEM_ARGS="--resolution 512 --batch_sizes 8 --checkpointing 0,1 --peer false --warmup 3 --timed_steps 5"
    ESTIMATE_ARGS="--grid \"\""
    SAMPLING_ARGS="--resolution 512 --batch_sizes 1 --steps 50 --repeats 3 --modes eager,default"
    ENCODE_ARGS="--vae sd1 --resolution 512 --images 512 --per_shard 128 --batch_size 64 --workers 16"
fi

DATE=$(date +%F)
OUT="${OUT:-bench/results/gpu_suite_${DATE}_${GPU_NAME}.md}"
mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d)
PRELOAD_PID=""
trap '[ -n "$PRELOAD_PID" ] && kill "$PRELOAD_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
PYRUN=("$PY")  # how a piece's `$PY SCRIPT.py ARGS` runs (see start_preload)
PRELOAD_MODULES="bench.harness sd.model sd.train.step sd.train.memory sd.sampling
    diffusers.models.unets.unet_2d_condition diffusers.models.autoencoders.autoencoder_kl diffusers.schedulers
    diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion transformers.models.clip.modeling_clip"
if [ "$SMOKE" = 1 ]; then
    # shellcheck disable=SC2086
    "$PY" bench/preload.py serve "$WORK/preload.sock" $PRELOAD_MODULES >"$WORK/preload.log" 2>&1 &
    PRELOAD_PID=$!
fi

# use_preload: once the server started above is listening, `$PY SCRIPT.py` pieces run through it; if it
# fails to start, they run in fresh processes and the reason is printed.
use_preload() {
    [ -z "$PRELOAD_PID" ] && return
    local tenths=0
    while [ ! -S "$WORK/preload.sock" ]; do
        if ! kill -0 "$PRELOAD_PID" 2>/dev/null || [ "$tenths" -ge 3000 ]; then
            echo "[gpu_suite] bench/preload.py did not start; the pieces run in fresh processes:" >&2
            cat "$WORK/preload.log" >&2
            return
        fi
        sleep 0.1
        tenths=$((tenths + 1))
    done
    PYRUN=("$PY" bench/preload.py run "$WORK/preload.sock")
}
BODY="$WORK/body.md"
SUMMARY="$WORK/summary.md"
PARTIAL="${OUT%.md}.partial.md"
: >"$BODY"
printf '| piece | how it ended | seconds |\n|---|---|---|\n' >"$SUMMARY"
START=$(date +%s)
SECTION=0

# run_piece TITLE TIMEOUT COMMAND...: the command under its timeout (and what is left of the budget),
# its output turned into a Markdown section.
run_piece() {
    local title="$1" limit="$2"; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    SECTION=$((SECTION + 1))
    local log="$WORK/$SECTION.log"
    if [ "$left" -lt 30 ]; then
        printf '## %s\n\n    %s\n\nnot run: the suite'"'"'s budget of %s s was spent\n\n' "$title" "$*" "$BUDGET" >>"$BODY"
        printf '| %s | not run (budget spent) | 0 |\n' "$title" >>"$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[gpu_suite] $title (timeout ${limit} s): $*" >&2
    local command=("$@")
    if [ "$1" = "$PY" ] && [[ "${2:-}" == *.py ]]; then command=("${PYRUN[@]}" "${@:2}"); fi
    local began=$(date +%s)
    timeout --kill-after=30 "$limit" "${command[@]}" >"$log" 2>&1
    local rc=$?
    local seconds=$(($(date +%s) - began))
    "$PY" bench/gpu_suite_report.py section --title "$title" --command "$*" --log "$log" --rc "$rc" \
        --seconds "$seconds" --timeout "$limit" >>"$BODY"
    local ended="ok"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then ended="timed out"; elif [ "$rc" != 0 ]; then ended="failed ($rc)"; fi
    printf '| %s | %s | %s |\n' "$title" "$ended" "$seconds" >>"$SUMMARY"
    cat "$PARTIAL_HEADER" "$SUMMARY" - "$BODY" <<<"" >"$PARTIAL"
}

# auto_batch RESOLUTION: the batch `batch_size: auto` picks for the step at RESOLUTION (empty if it fails).
auto_batch() {
    timeout 600 "${PYRUN[@]}" bench/gpu_suite_report.py auto_batch --arch "$ARCH" --resolution "$1" \
        --precision "$PRECISION" $AUTO_ARGS 2>"$WORK/auto_$1.log" | tail -n 1
}

TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "unknown")
use_preload
PARTIAL_HEADER="$WORK/header.md"
{
    echo "# GPU benchmark suite, $DATE"
    echo
    if [ "$SMOKE" = 1 ]; then
        echo "**--smoke**: every piece at the tiniest size on the CPU; the numbers test the script, they measure nothing."
        if [ "${PYRUN[1]:-}" = bench/preload.py ]; then
            echo "Its Python pieces ran in children of one interpreter that imported torch, diffusers and transformers."
        fi
    else
        echo "Device: $GPUS x $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"
    fi
    echo
    echo "torch $TORCH; revision $(git rev-parse --short HEAD 2>/dev/null || echo unknown); command: \`bash bench/gpu_suite.sh$([ "$SMOKE" = 1 ] && echo ' --smoke')\`"
    echo
} >"$PARTIAL_HEADER"

PEAK=""
[ "$SMOKE" = 1 ] && PEAK="--peak_tflops 1"  # so the MFU column is exercised on the CPU

declare -A AUTO
for res in $RESOLUTIONS; do
    AUTO[$res]=$(auto_batch "$res")
    batches="$BATCHES ${AUTO[$res]}"
    run_piece "Training step, ${res} px, eager: batch ${BATCHES// /, } and auto (${AUTO[$res]:-failed})" 600 \
        "$PY" bench/train_throughput.py --device "$DEVICE" --arch "$ARCH" --resolution "$res" --precision "$PRECISION" \
        --batch_sizes "$(echo $batches | tr ' ' ',')" --variants eager --channels_last 0 --checkpointing 0 \
        --peers "" $STEPS $PEAK
done

# run_compiled RESOLUTION:BATCH (BATCH may be auto): the compiled step at one batch (a compile per shape).
run_compiled() {
    local res=${1%%:*} batch=${1##*:}
    [ "$batch" = auto ] && batch=${AUTO[$res]:-}
    [ -z "$batch" ] && return
    run_piece "Training step, ${res} px, compiled: batch $batch" 420 \
        "$PY" bench/train_throughput.py --device "$DEVICE" --arch "$ARCH" --resolution "$res" \
        --precision "$PRECISION" --batch_sizes "$batch" --variants compile --channels_last 0 --checkpointing 0 \
        --peers "" $STEPS $PEAK
}
for point in $COMPILE_FIRST; do run_compiled "$point"; done
# torch.compile's other modes (compile_mode) at 512 px, batch 16: CUDA graphs and kernel autotuning.
if [ -n "$COMPILE_FIRST" ]; then
    run_piece "Training step, 512 px, compile modes: batch 16" 600 \
        "$PY" bench/train_throughput.py --device "$DEVICE" --arch "$ARCH" --resolution 512 --precision "$PRECISION" \
        --batch_sizes 16 --variants compile --compile_modes reduce-overhead,max-autotune-no-cudagraphs \
        --channels_last 0 --checkpointing 0 --peers "" $STEPS $PEAK
fi

PEER_ARGS=()
if [ -n "$PEER_SCRIPT" ]; then PEER_ARGS=(--peer_script "$PEER_SCRIPT"); fi
res=${RESOLUTIONS%% *}
run_piece "Ours vs diffusers' train_text_to_image.py step, ${res} px, batch $PEER_BATCH${PEER_SCRIPT:+ (and the script end to end)}" 600 \
    "$PY" bench/train_throughput.py --device "$DEVICE" --arch "$ARCH" --resolution "$res" --precision "$PRECISION" \
    --batch_sizes "$PEER_BATCH" --variants eager --channels_last 0 --checkpointing 0 --peers unet,vae $STEPS $PEAK \
    "${PEER_ARGS[@]}"

if [ "$DDP_RANKS" -gt 1 ]; then
    DDP_TITLE="DDP on $DDP_RANKS $([ "$SMOKE" = 1 ] && echo 'CPU processes (gloo)' || echo GPUs) vs one"
    DDP_RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$DDP_RANKS" bench/ddp_step.py
             --device "$DEVICE" $DDP_ARGS)
    run_piece "$DDP_TITLE" 600 "${DDP_RUN[@]}"
    # --smoke on a shared CPU machine: a parallel torchrun can take the free port a standalone launch picked
    # before it binds it; that launch is tried once more (its first log stays in the report above it)
    if [ "$SMOKE" = 1 ] && ! tail -n 1 "$SUMMARY" | grep -q '| ok |'; then
        sed -i '$ d' "$SUMMARY"
        run_piece "$DDP_TITLE" 600 "${DDP_RUN[@]}"
    fi
else
    printf '## DDP\n\nnot run: one GPU visible\n\n' >>"$BODY"
    printf '| DDP | not run (one GPU) | 0 |\n' >>"$SUMMARY"
fi

run_piece "Peak memory, measured against sd.train.memory's estimate (full fine-tuning and LoRA, EMA on)" 600 \
    "$PY" bench/lora_step.py --device "$DEVICE" --arch "$ARCH" --precision "$PRECISION" --ema $MEM_ARGS
eval "ESTIMATE=($ESTIMATE_ARGS)"
run_piece "Memory estimate: SD 1.x predictions against published peaks" 300 \
    "$PY" bench/memory_estimate.py "${ESTIMATE[@]}"
run_piece "Sampling: DDIM iterations/s vs diffusers' StableDiffusionPipeline" 600 \
    "$PY" bench/sampling.py --device "$DEVICE" --arch "$ARCH" $SAMPLING_ARGS
run_piece "Latent encoding: encode_latents.py vs the naive loop" 600 \
    "$PY" bench/encode_throughput.py --device "$DEVICE" $ENCODE_ARGS
run_piece "pytest -m gpu" 900 "$PY" -m pytest -m gpu tests/gpu -p no:xdist -p no:cacheprovider -o addopts="" -q

for point in $COMPILE_LATER; do run_compiled "$point"; done

cat "$PARTIAL_HEADER" "$SUMMARY" - "$BODY" <<<"" >"$PARTIAL"
mv "$PARTIAL" "$OUT"
echo "[gpu_suite] $(($(date +%s) - START)) s; wrote $OUT" >&2

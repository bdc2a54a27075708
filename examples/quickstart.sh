#!/usr/bin/env bash
# Quick start: build a tokenizer and a dataset from the Python standard library's sources
# (cached under data/), then pretrain a small GPT on 8 CPU processes (python -m megareshard.launch:
# torchrun's arguments and agent, a failing rank told in one line with where its log is),
# tp 2 · pp 2 · dp 2: two pipeline stages (each a 2x2 dp × tp mesh) under eager-1F1B with
# delayed weight gradients, stage boundaries resharded by pipelined broadcast. Shows the
# loss falling, the peak memory per stage, draws the measured pipeline timeline of the last
# iteration, saves a checkpoint and ends with the command that samples from it. It installs
# only what training needs (tools/ensure_venv.sh: megareshard with its `plots` extra), and
# checks the arguments once before the launcher starts a process per rank. A previous run's outputs in
# RUN_DIR (checkpoints, metrics, trace, timeline, logs, W&B) are kept: moved to RUN_DIR-<when that run
# ended>, and the script says where. Everything is overridable from the environment:
#
#   TRAIN_ITERS=200 NPROC=4 TP=2 PP=1 bash examples/quickstart.sh
#   SCHEDULE=1f1b DELAY_WGRAD=0 RESHARD_STRATEGY=sendrecv bash examples/quickstart.sh
#   EXTRA_ARGS="--sequence-parallel" bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh   # MEGARESHARD_EXTRAS (default plots): no test packages, no DeepSpeed

NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
SCHEDULE=${SCHEDULE:-eager-1f1b}
DELAY_WGRAD=${DELAY_WGRAD:-1}
RESHARD_STRATEGY=${RESHARD_STRATEGY:-broadcast}
TRAIN_ITERS=${TRAIN_ITERS:-60}
VOCAB=${VOCAB:-4096}
SEQ=${SEQ:-128}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
LR=${LR:-1e-3}
DATA_DIR=${DATA_DIR:-data}
RUN_DIR=${RUN_DIR:-runs/quickstart}
EXTRA_ARGS=${EXTRA_ARGS:-}
export WANDB_MODE=${WANDB_MODE:-offline}

mkdir -p "$RUN_DIR"
DATA_DIR=$DATA_DIR VOCAB=$VOCAB bash examples/prepare_data.sh

PIPELINE_ARGS="--pipeline-schedule $SCHEDULE --reshard-strategy $RESHARD_STRATEGY --pipeline-trace $RUN_DIR/trace.json"
if [ "$DELAY_WGRAD" = "1" ] && [ "$PP" -gt 1 ]; then PIPELINE_ARGS="$PIPELINE_ARGS --delay-wgrad-compute"; fi
# shellcheck disable=SC2206
TRAIN_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr 1e-4 --lr-warmup-iters 5 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
    --device cpu --hidden-dropout 0 --attention-dropout 0
    --data-path "$DATA_DIR/stdlib_text_document" --tokenizer-model "$DATA_DIR/tokenizer.model"
    --split 98,2,0 --eval-interval 20 --eval-iters 2 --log-interval 5
    --metrics-file "$RUN_DIR/metrics.jsonl" --save "$RUN_DIR/checkpoints"
    --wandb-project megareshard-quickstart --wandb-exp-name quickstart --wandb-save-dir "$RUN_DIR"
    $PIPELINE_ARGS $EXTRA_ARGS)

# the arguments, tokenizer and data checked once, in this process: a mistake is one line, not one per rank
WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$VENV_PY" pretrain_gpt.py --validate-only "${TRAIN_ARGS[@]}"

# a previous run's outputs are kept, never removed: moved aside to RUN_DIR-<when it ended>, said in one line
# (after the argument check: a mistyped flag moves nothing)
OUTPUTS=(checkpoints metrics.jsonl trace.json timeline.png logs wandb)
previous=()
for f in "${OUTPUTS[@]}"; do [ -e "$RUN_DIR/$f" ] && previous+=("$RUN_DIR/$f"); done
if [ ${#previous[@]} -gt 0 ]; then
    ended=$(ls -td "${previous[@]}"); ended=${ended%%$'\n'*}   # the newest (no `| head`: pipefail)
    KEPT="${RUN_DIR%/}-$(date -r "$ended" +%Y%m%d-%H%M%S 2>/dev/null || date +%Y%m%d-%H%M%S)"
    [ -e "$KEPT" ] && KEPT="$KEPT-$$"
    mkdir -p "$KEPT"
    mv "${previous[@]}" "$KEPT/"
    echo "== $RUN_DIR held a previous run: kept in $KEPT (its checkpoints: $KEPT/checkpoints); this run starts afresh"
fi

echo "== pretraining: $NPROC CPU processes, tp $TP, pp $PP ($SCHEDULE, delayed W $DELAY_WGRAD, $RESHARD_STRATEGY" \
     "resharding), $TRAIN_ITERS iterations (metrics: $RUN_DIR/metrics.jsonl)"
# the launcher's scratch files go to a temp dir we remove; each rank's output is kept in $RUN_DIR/logs
export TMPDIR=$(mktemp -d -t megareshard-quickstart.XXXXXX)
trap 'rm -rf "$TMPDIR"' EXIT
"$VENV_PY" -m megareshard.launch --standalone --nproc-per-node "$NPROC" --log-dir "$RUN_DIR/logs" \
    pretrain_gpt.py "${TRAIN_ARGS[@]}"

"$VENV_PY" - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
first, last = recs[0]["loss"], recs[-1]["loss"]
print(f"== loss {first:.3f} (iteration 1) -> {last:.3f} (iteration {recs[-1]['iteration']}): "
      + ("falling" if last < first else "NOT falling"))
mem = recs[-1].get("peak_mem_mb_per_stage")
if mem:
    print("== peak memory per pipeline stage (MiB): " + ", ".join(f"stage {i} {v:.0f}" for i, v in enumerate(mem)))
PY
if [ -f "$RUN_DIR/trace.json" ]; then
    "$VENV_PY" tools/plot_schedule.py --trace "$RUN_DIR/trace.json" -o "$RUN_DIR/timeline.png" \
        && echo "== measured pipeline timeline of the last iteration: $RUN_DIR/timeline.png"
fi
echo "== sample from the checkpoint it saved (its tokenizer is recorded in it):"
echo "   $VENV_PY tools/generate.py --load $RUN_DIR/checkpoints --prompt 'def main(' --max-new-tokens 40"

#!/usr/bin/env bash
# Pretrain briefly at one parallel layout, then continue / fine-tune from that checkpoint at
# another: the checkpoint (torch.distributed.checkpoint, global names and boxes) is re-sliced,
# not converted. Prints both layouts, what the load carried over (and any state that cannot be
# exact in the new layout), and the loss continuing. Mock data: nothing to download.
#
#   bash examples/finetune_new_layout.sh                      # tp2·pp2·dp2 ZeRO 1 -> tp1·pp1·dp8 ZeRO 2, resumed
#   FINETUNE=1 bash examples/finetune_new_layout.sh           # weights only: fresh optimizer, iteration 0
#   SRC="--tensor-model-parallel-size 4 --zero-stage 0" DST="--pipeline-model-parallel-size 4" bash examples/finetune_new_layout.sh
#   python tools/checkpoint_util.py inspect runs/finetune_new_layout/pretrain   # what was saved
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh

NPROC=${NPROC:-8}
SRC=${SRC:-"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1"}
DST=${DST:-"--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --zero-stage 2"}
PRETRAIN_ITERS=${PRETRAIN_ITERS:-10}
TOTAL_ITERS=${TOTAL_ITERS:-20}
FINETUNE=${FINETUNE:-0}
RUN_DIR=${RUN_DIR:-runs/finetune_new_layout}
export WANDB_MODE=${WANDB_MODE:-offline} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
COMMON="--mock-data --vocab-size 1000 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
        --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
        --train-iters $TOTAL_ITERS --lr-decay-iters $TOTAL_ITERS --log-interval 1 --device cpu
        --hidden-dropout 0 --attention-dropout 0"

rm -rf "$RUN_DIR"; mkdir -p "$RUN_DIR"
export TMPDIR=$(mktemp -d -t megareshard-finetune.XXXXXX)
trap 'rm -rf "$TMPDIR"' EXIT
# the launcher: torchrun's arguments and agent; a failing rank in one line, with where its log is
run() {
    "$VENV_PY" -m megareshard.launch --standalone --nproc-per-node "$NPROC" --log-dir "$RUN_DIR/logs" pretrain_gpt.py "$@"
}
# both layouts' arguments checked once, in this process, before the launcher starts a process per rank
# shellcheck disable=SC2086
for layout in "$SRC" "$DST"; do
    WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$VENV_PY" pretrain_gpt.py --validate-only $COMMON $layout
done

echo "== 1. pretrain $PRETRAIN_ITERS iterations at layout: $SRC ($NPROC processes)"
# shellcheck disable=SC2086
run $COMMON $SRC --save "$RUN_DIR/pretrain" --exit-interval "$PRETRAIN_ITERS" 2>&1 | tee "$RUN_DIR/pretrain.log" \
    | grep -E "megareshard:|megareshard-run:|: error:|iteration +[0-9]+/|checkpoint:|exiting"
"$VENV_PY" tools/checkpoint_util.py inspect "$RUN_DIR/pretrain" --summary

if [ "$FINETUNE" = "1" ]; then MODE="--finetune"; WHAT="fine-tune (weights only)"; else MODE=""; WHAT="resume"; fi
echo "== 2. $WHAT at layout: $DST ($NPROC processes) from $RUN_DIR/pretrain"
# shellcheck disable=SC2086
run $COMMON $DST --load "$RUN_DIR/pretrain" $MODE --save "$RUN_DIR/continued" 2>&1 | tee "$RUN_DIR/continued.log" \
    | grep -E "megareshard:|megareshard-run:|: error:|iteration +[0-9]+/|checkpoint:|WARNING"
echo "== the loss continues from iteration $PRETRAIN_ITERS (compare the last lines of step 1 with the first of step 2)"

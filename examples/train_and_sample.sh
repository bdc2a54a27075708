#!/usr/bin/env bash
# Train and sample in one job (issue #50): a trainer at tp 2 · pp 2 on four CPU processes and two generator
# replicas — tp 2 on two more processes and tp 1 on one — that receive the trainer's weights after every
# TRANSFER_INTERVAL optimizer steps (a planned weight transfer, megareshard/transfer.py) and continue a few
# prompts greedily with a key/value cache between updates, printing
#
#     generator tp2 (step 10): 'def main(' -> ...
#
# as training goes. The data and tokenizer are the quick start's (examples/prepare_data.sh, cached under
# DATA_DIR). Overridable from the environment:
#
#   TRAIN_ITERS=40 TRANSFER_INTERVAL=10 bash examples/train_and_sample.sh
#   GENERATORS=tp1,tp1,tp1 bash examples/train_and_sample.sh      # three tp-1 replicas (7 ranks as well)
#   DRY_RUN=1 bash examples/train_and_sample.sh                   # print the check and launcher commands, exit
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh

TP=${TP:-2}
PP=${PP:-2}
GENERATORS=${GENERATORS:-tp2,tp1}
TRAIN_ITERS=${TRAIN_ITERS:-20}
TRANSFER_INTERVAL=${TRANSFER_INTERVAL:-5}
PROMPTS=${PROMPTS:-"def main(|import os|class Config("}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-24}
VOCAB=${VOCAB:-4096}
SEQ=${SEQ:-128}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
LR=${LR:-2e-3}
DATA_DIR=${DATA_DIR:-data}
RUN_DIR=${RUN_DIR:-runs/train_and_sample}
DRY_RUN=${DRY_RUN:-0}
# the trainer's ranks plus one per generator tensor-parallel rank
GEN_RANKS=$(( $(echo "$GENERATORS" | sed 's/tp//g; s/,/+/g') ))
NPROC=${NPROC:-$((TP * PP + GEN_RANKS))}

TRAIN_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
    --device cpu --hidden-dropout 0 --attention-dropout 0
    --data-path "$DATA_DIR/stdlib_text_document" --tokenizer-model "$DATA_DIR/tokenizer.model"
    --split 98,2,0 --eval-interval 0 --log-interval "$TRANSFER_INTERVAL"
    --metrics-file "$RUN_DIR/metrics.jsonl"
    --generator-layouts "$GENERATORS" --transfer-interval "$TRANSFER_INTERVAL" --transfer-bucket-mb 4
    --generator-prompts "$PROMPTS" --generator-max-new-tokens "$MAX_NEW_TOKENS")
VALIDATE_CMD=("$VENV_PY" pretrain_gpt.py --validate-only "${TRAIN_ARGS[@]}")
CMD=("$VENV_PY" -m megareshard.launch --standalone --nproc-per-node "$NPROC" --log-dir "$RUN_DIR/logs"
     pretrain_gpt.py "${TRAIN_ARGS[@]}")
if [ "$DRY_RUN" = 1 ]; then
    echo "WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC $(printf '%q ' "${VALIDATE_CMD[@]}")"
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi

DATA_DIR=$DATA_DIR VOCAB=$VOCAB bash examples/prepare_data.sh
# the arguments, tokenizer and data checked once, in this process: a mistake is one line, not one per rank
WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "${VALIDATE_CMD[@]}"
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/metrics.jsonl"
echo "== training at tp $TP · pp $PP on ranks 0-$((TP * PP - 1)), generators $GENERATORS on ranks $((TP * PP))-$((NPROC - 1))," \
     "weights pushed every $TRANSFER_INTERVAL step(s), $TRAIN_ITERS iterations"
export TMPDIR=$(mktemp -d -t megareshard-train-and-sample.XXXXXX)
trap 'rm -rf "$TMPDIR"' EXIT
"${CMD[@]}"
"$VENV_PY" - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
pushes = [r for r in recs if "transfer_bytes" in r]
print(f"== {len(pushes)} weight transfer(s), {pushes[-1]['transfer_bytes'] / 2**20:.2f} MiB each; loss "
      f"{recs[0]['loss']:.3f} (iteration 1) -> {recs[-1]['loss']:.3f} (iteration {recs[-1]['iteration']})")
PY

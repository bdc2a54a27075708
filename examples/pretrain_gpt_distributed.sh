#!/usr/bin/env bash
# Multi-node GPT pretraining with torchrun. Run the same script on every node:
#
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0.cluster MASTER_PORT=29500 GPUS_PER_NODE=8 \
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=/data/tokenizer.model \
#       bash examples/pretrain_gpt_distributed.sh
#
#   RDZV=c10d ...           use torchrun's c10d rendezvous (elastic, any node may host it)
#   DRY_RUN=1 ...           print the torchrun command and exit
#   DEVICE=cpu ...          CPU processes over gloo (one "GPU" = one process)
#
# Network interfaces: NCCL picks one itself; set NCCL_SOCKET_IFNAME (e.g. ib0 or eth0) and, for gloo,
# GLOO_SOCKET_IFNAME when nodes have several interfaces and the default one cannot reach the others.
# Every rank waits --preflight-timeout seconds for all NNODES × GPUS_PER_NODE ranks and names the
# missing ones; then rank 0 prints the rank map (host → ranks with their pp/tp/dp coordinates).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${NNODES:=1}" "${NODE_RANK:=0}" "${GPUS_PER_NODE:=8}" "${MASTER_PORT:=29500}" "${RDZV:=static}"
: "${DEVICE:=cuda}" "${DRY_RUN:=0}"
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    echo "error: MASTER_ADDR must name node 0's address when NNODES=$NNODES > 1 (no localhost fallback)" >&2
    exit 2
fi
: "${MASTER_ADDR:=127.0.0.1}"
# tensor-parallel communication overlap on GPUs relies on kernels being launched in issue order
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}

TP=${TP:-2}; PP=${PP:-2}
MODEL_ARGS=(--num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN_SIZE:-1024}"
            --num-attention-heads "${NUM_HEADS:-16}" --seq-length "${SEQ_LENGTH:-2048}"
            --max-position-embeddings "${SEQ_LENGTH:-2048}")
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --pipeline-schedule "${SCHEDULE:-eager-1f1b}" --reshard-strategy "${RESHARD:-broadcast}")
[ "${DELAY_WGRAD:-1}" = 1 ] && [ "$PP" -gt 1 ] && PARALLEL_ARGS+=(--delay-wgrad-compute)
[ "${SEQUENCE_PARALLEL:-0}" = 1 ] && PARALLEL_ARGS+=(--sequence-parallel)
TRAINING_ARGS=(--micro-batch-size "${MICRO_BATCH:-2}" --global-batch-size "${GLOBAL_BATCH:-256}"
               --train-iters "${TRAIN_ITERS:-10000}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
               --lr-warmup-iters "${WARMUP:-500}" --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --device "$DEVICE"
               --preflight-timeout "${PREFLIGHT_TIMEOUT:-300}" --comm-timeout "${COMM_TIMEOUT:-600}")
if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}"
               --split "${SPLIT:-969,30,1}")
else
    DATA_ARGS=(--mock-data --vocab-size "${VOCAB_SIZE:-50257}")
fi
LOGGING_ARGS=(--log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters 10
              --metrics-file "${RUN_DIR:-runs/gpt}/metrics.jsonl")
[ -n "${WANDB_PROJECT:-}" ] && LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-save-dir "${RUN_DIR:-runs/gpt}")

if [ "$RDZV" = c10d ]; then
    LAUNCH=(--nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
            --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megareshard}")
else
    LAUNCH=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
CMD=("$PY" -m torch.distributed.run "${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}"
     "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" ${EXTRA_ARGS:-})
if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
mkdir -p "${RUN_DIR:-runs/gpt}"
exec "${CMD[@]}"

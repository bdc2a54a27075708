#!/usr/bin/env bash
# Multi-node GPT pretraining with megareshard's launcher (python -m megareshard.launch: torchrun's arguments and
# elastic agent; a failing rank is one line naming its log, under RUN_DIR/logs/node<NODE_RANK>). Run the same
# script on every node:
#
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0.cluster MASTER_PORT=29500 GPUS_PER_NODE=8 \
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=/data/tokenizer.model \
#       bash examples/pretrain_gpt_distributed.sh
#
#   RDZV=c10d ...           use torchrun's c10d rendezvous (elastic, any node may host it)
#   DRY_RUN=1 ...           print the argument check, pre-flight and launcher commands and exit
#   VALIDATE_ONLY=1 ...     check the arguments, tokenizer and data (pretrain_gpt.py --validate-only) and exit
#   VALIDATE=0 ...          skip that check before the launcher (the Slurm script ran it once for every node)
#   DEVICE=cpu ...          CPU processes over gloo (one "GPU" = one process)
#
# Before anything else the arguments are checked once, in one process, for all NNODES × GPUS_PER_NODE ranks
# (pretrain_gpt.py --validate-only): a bad flag is one line and exit code 2, not a line per rank and
# torchrun's traceback.
#
# Faults (docs/reliability.md, "Ranks, nodes and preemption"):
# * Before the launcher, every node runs a node pre-flight (megareshard.launch.node_preflight, on port
#   MASTER_PORT+1 or PREFLIGHT_PORT): a node that never starts is named (node rank, and the hosts that did
#   join) within PREFLIGHT_TIMEOUT seconds, where torchrun's own rendezvous would block silently. PREFLIGHT=0 skips it.
# * A MASTER_PORT already in use on the node that hosts the rendezvous is named in one line before the launcher
#   starts (megareshard/launch/port_check.py; PORT_CHECK=0 skips it: needed only to run several nodes of one
#   job on one machine with PREFLIGHT=0).
# * Auto-resume: --save and --load both name CHECKPOINT_PATH (default $RUN_DIR/checkpoints): a run starts
#   fresh when it holds no checkpoint and resumes from its newest complete one otherwise; the launcher (torch's
#   elastic agent) restarts the workers up to MAX_RESTARTS (default 3) times after a rank dies, and each restart
#   resumes the same way.
# * Preemption: --exit-signal-handler; a SIGTERM to this script or to the training processes (Slurm's
#   --signal=TERM@120, scancel) saves at the next iteration boundary and exits 0. The script ends by exec'ing
#   the launcher, which forwards SIGTERM to its workers and waits for their save (torchrun would kill them after
#   its --shutdown-timeout and exit 1).
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
CHECKPOINT_PATH=${CHECKPOINT_PATH:-${RUN_DIR:-runs/gpt}/checkpoints}
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-1000}"
                 --exit-signal-handler)
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
    LAUNCH=(--max-restarts "${MAX_RESTARTS:-3}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
            --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megareshard}")
else
    LAUNCH=(--max-restarts "${MAX_RESTARTS:-3}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
# shellcheck disable=SC2206
TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
            "${LOGGING_ARGS[@]}" ${EXTRA_ARGS:-})
CMD=("$PY" -m megareshard.launch "${LAUNCH[@]}" --log-dir "${RUN_DIR:-runs/gpt}/logs/node$NODE_RANK" pretrain_gpt.py
     "${TRAIN_ARGS[@]}")
VALIDATE_CMD=(env WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) LOCAL_WORLD_SIZE="$GPUS_PER_NODE" "$PY" pretrain_gpt.py
              --validate-only "${TRAIN_ARGS[@]}")
PREFLIGHT_CMD=()
if [ "$NNODES" -gt 1 ] && [ "${PREFLIGHT:-1}" = 1 ]; then
    PREFLIGHT_CMD=("$PY" -m megareshard.launch.node_preflight --nnodes "$NNODES" --node-rank "$NODE_RANK"
                   --master-addr "$MASTER_ADDR" --port "${PREFLIGHT_PORT:-$((MASTER_PORT + 1))}"
                   --timeout "${PREFLIGHT_TIMEOUT:-300}" --rdzv "$RDZV")
fi
if [ "$DRY_RUN" = 1 ]; then
    if [ "${VALIDATE:-1}" = 1 ] || [ "${VALIDATE_ONLY:-0}" = 1 ]; then printf '%q ' "${VALIDATE_CMD[@]}"; echo; fi
    [ "${VALIDATE_ONLY:-0}" = 1 ] && exit 0
    if [ ${#PREFLIGHT_CMD[@]} -gt 0 ]; then printf '%q ' "${PREFLIGHT_CMD[@]}"; echo; fi
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
if [ "${VALIDATE:-1}" = 1 ] || [ "${VALIDATE_ONLY:-0}" = 1 ]; then
    "${VALIDATE_CMD[@]}" || exit $?
fi
[ "${VALIDATE_ONLY:-0}" = 1 ] && exit 0
# a MASTER_PORT someone else listens on: one line now, not torchrun's EADDRINUSE traceback (static) or a
# silent wait (c10d); checked on the node that hosts the rendezvous, before any node starts the launcher
if [ "${PORT_CHECK:-1}" = 1 ]; then
    "$PY" megareshard/launch/port_check.py --master-addr "$MASTER_ADDR" --rdzv "$RDZV" --node-rank "$NODE_RANK" \
        --port "$MASTER_PORT" || exit $?
fi
mkdir -p "${RUN_DIR:-runs/gpt}"
if [ ${#PREFLIGHT_CMD[@]} -gt 0 ]; then
    # (the store's C++ client logs every connection retry while it waits for node 0: keep it quiet)
    TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-FATAL} "${PREFLIGHT_CMD[@]}" || exit $?
fi
# the launcher takes this process's place: a SIGTERM to the script reaches it, and it forwards the signal to the
# training processes (--exit-signal-handler: they save at the next iteration boundary and exit 0, and so does it)
exec "${CMD[@]}"

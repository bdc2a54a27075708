#!/usr/bin/env bash
# The quick start's model on an emulated cluster: 4 hosts × 2 ranks, each host a network namespace
# with one 1 Gbit/s NIC (lab/cluster/emulate_cluster.py; needs root). You see a multi-host run: the
# pre-flight rank map (host → ranks), the placement (tp inside a host, then dp, then pp across
# hosts) and the throughput over slow links — on one machine.
#   HOSTS=4 PROCS_PER_HOST=2 NIC_RATE=1gbit TP=2 PP=2 TRAIN_ITERS=20 bash examples/emulated_cluster.sh
# PREFIX names the namespaces (<PREFIX>h0, …, <PREFIX>sw; default mr<pid>).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh
if [ "$(id -u)" != 0 ]; then
    echo "error: the emulated cluster creates network namespaces and needs root" >&2
    exit 2
fi
HOSTS=${HOSTS:-4}; PROCS_PER_HOST=${PROCS_PER_HOST:-2}; NIC_RATE=${NIC_RATE:-1gbit}
TP=${TP:-2}; PP=${PP:-2}; TRAIN_ITERS=${TRAIN_ITERS:-20}
DATA_DIR=${DATA_DIR:-data}; RUN_DIR=${RUN_DIR:-runs/emulated_cluster}
DATA_DIR=$DATA_DIR bash examples/prepare_data.sh
mkdir -p "$RUN_DIR"; rm -f "$RUN_DIR/metrics.jsonl"
export WANDB_MODE=${WANDB_MODE:-offline}
echo "== $HOSTS hosts × $PROCS_PER_HOST ranks, NIC $NIC_RATE per host; tp $TP, pp $PP"
# shellcheck disable=SC2086
TRAIN_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "${LAYERS:-4}" --hidden-size "${HIDDEN:-128}" --num-attention-heads 4 --seq-length 128
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
    --lr-warmup-iters 2 --device cpu --hidden-dropout 0 --attention-dropout 0 --data-path "$DATA_DIR/stdlib_text_document"
    --tokenizer-model "$DATA_DIR/tokenizer.model" --split 98,2,0 --log-interval "${LOG_INTERVAL:-5}"
    --metrics-file "$RUN_DIR/metrics.jsonl" ${EXTRA_ARGS:-})
# the arguments checked once, in this process, before a torchrun per host starts: a mistake is one line
WORLD_SIZE=$((HOSTS * PROCS_PER_HOST)) LOCAL_WORLD_SIZE=$PROCS_PER_HOST "$VENV_PY" pretrain_gpt.py --validate-only \
    "${TRAIN_ARGS[@]}"
"$VENV_PY" -m lab.cluster.emulate_cluster --hosts "$HOSTS" --procs-per-host "$PROCS_PER_HOST" --nic-rate "$NIC_RATE" \
    ${TIMEOUT:+--timeout "$TIMEOUT"} ${PREFIX:+--prefix "$PREFIX"} -- pretrain_gpt.py "${TRAIN_ARGS[@]}"
"$VENV_PY" - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steady = recs[len(recs) // 2:]
print(f"== loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}; steady state "
      f"{statistics.median(r['tokens_per_s'] for r in steady):.0f} tokens/s, "
      f"{statistics.median(r['ms_per_iter'] for r in steady):.0f} ms/iteration")
PY

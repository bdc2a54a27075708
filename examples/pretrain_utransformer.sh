#!/usr/bin/env bash
# U-Transformer on CPU processes: a 4-stage pipeline whose long skip connections cross
# non-adjacent stages (skip0: stage 0 -> 3, skip1: stage 1 -> 3), every stage with its own
# layout (--stage-layouts), eager-1F1B with delayed weight gradients, every edge (chain and
# skip) resharded by pipelined broadcast. Trains on the quick start's stdlib dataset
# (built/cached under data/ by examples/prepare_data.sh) and shows the loss falling.
# A couple of minutes on 2 cores. Everything is overridable from the environment:
#
#   NPROC=4 STAGE_LAYOUTS=tp1dp1,tp1dp1,tp1dp1,tp1dp1 bash examples/pretrain_utransformer.sh
#   SKIP_MERGE=concat SCHEDULE=1f1b DELAY_WGRAD=0 RESHARD_STRATEGY=sendrecv bash examples/pretrain_utransformer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh

NPROC=${NPROC:-6}
STAGE_LAYOUTS=${STAGE_LAYOUTS:-tp1dp1,tp2dp1,tp1dp1,tp1dp2}
LAYERS_PER_STAGE=${LAYERS_PER_STAGE:-1,1,1,2}   # over the U's flat block list: enc0 | enc1 | bottom | dec1 dec0
LEVELS=${LEVELS:-3}
WIDTHS=${WIDTHS:-64,96,128}
BLOCKS=${BLOCKS:-1}
SHORTEN=${SHORTEN:-2}
SKIP_MERGE=${SKIP_MERGE:-add}
HEADS=${HEADS:-4}
SCHEDULE=${SCHEDULE:-eager-1f1b}
DELAY_WGRAD=${DELAY_WGRAD:-1}
RESHARD_STRATEGY=${RESHARD_STRATEGY:-broadcast}
TRAIN_ITERS=${TRAIN_ITERS:-40}
VOCAB=${VOCAB:-4096}
SEQ=${SEQ:-64}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
LR=${LR:-2e-3}
DATA_DIR=${DATA_DIR:-data}
RUN_DIR=${RUN_DIR:-runs/utransformer}
EXTRA_ARGS=${EXTRA_ARGS:-}
export WANDB_MODE=${WANDB_MODE:-offline}

mkdir -p "$RUN_DIR"
DATA_DIR=$DATA_DIR VOCAB=$VOCAB bash examples/prepare_data.sh

PIPELINE_ARGS="--pipeline-schedule $SCHEDULE --reshard-strategy $RESHARD_STRATEGY --pipeline-trace $RUN_DIR/trace.json"
if [ "$DELAY_WGRAD" = "1" ]; then PIPELINE_ARGS="$PIPELINE_ARGS --delay-wgrad-compute"; fi

echo "== U-Transformer: $NPROC CPU processes, stages $STAGE_LAYOUTS (blocks $LAYERS_PER_STAGE), widths $WIDTHS," \
     "skip merge $SKIP_MERGE, $SCHEDULE (delayed W $DELAY_WGRAD, $RESHARD_STRATEGY), $TRAIN_ITERS iterations"
rm -f "$RUN_DIR/metrics.jsonl" "$RUN_DIR/trace.json"
export TMPDIR=$(mktemp -d -t megareshard-utransformer.XXXXXX)
trap 'rm -rf "$TMPDIR"' EXIT
# shellcheck disable=SC2086
# shellcheck disable=SC2206
TRAIN_ARGS=(--stage-layouts "$STAGE_LAYOUTS" --num-layers-per-stage "$LAYERS_PER_STAGE"
    --u-levels "$LEVELS" --u-widths "$WIDTHS" --u-blocks-per-level "$BLOCKS" --u-shorten-factor "$SHORTEN"
    --u-skip-merge "$SKIP_MERGE" --num-attention-heads "$HEADS" --seq-length "$SEQ"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr 1e-4 --lr-warmup-iters 4 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
    --device cpu --hidden-dropout 0 --attention-dropout 0
    --data-path "$DATA_DIR/stdlib_text_document" --tokenizer-model "$DATA_DIR/tokenizer.model"
    --split 98,2,0 --log-interval 5 --metrics-file "$RUN_DIR/metrics.jsonl"
    $PIPELINE_ARGS $EXTRA_ARGS)
# the arguments checked once, in this process, before the launcher (torchrun's arguments and agent; a failing
# rank in one line, with where its log is) starts a process per rank
WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$VENV_PY" pretrain_utransformer.py --validate-only "${TRAIN_ARGS[@]}"
"$VENV_PY" -m megareshard.launch --standalone --nproc-per-node "$NPROC" --log-dir "$RUN_DIR/logs" \
    pretrain_utransformer.py "${TRAIN_ARGS[@]}"

"$VENV_PY" - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
first, last = recs[0]["loss"], recs[-1]["loss"]
print(f"== loss {first:.3f} (iteration 1) -> {last:.3f} (iteration {recs[-1]['iteration']}): "
      + ("falling" if last < first else "NOT falling"))
PY
if [ -f "$RUN_DIR/trace.json" ]; then
    "$VENV_PY" tools/plot_schedule.py --trace "$RUN_DIR/trace.json" -o "$RUN_DIR/timeline.png" \
        && echo "== measured pipeline timeline of the last iteration: $RUN_DIR/timeline.png"
fi

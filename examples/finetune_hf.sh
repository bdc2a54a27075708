#!/usr/bin/env bash
# Fine-tune a Hugging Face Llama in tp 2 · pp 2 · dp 2 (LAYOUT, NPROC) and give it back to transformers, all local:
#   1. a tiny random LlamaForCausalLM and its BPE tokenizer are made with transformers (no hub access);
#   2. a corpus is tokenized with that tokenizer (tools/preprocess_data.py, --tokenizer-type HuggingFaceTokenizer);
#   3. tools/checkpoint_util.py import-hf turns the model into a megareshard checkpoint (and prints its flags);
#   4. pretrain_gpt.py fine-tunes it on 8 CPU processes (--load ... --finetune), the loss falling;
#   5. export-hf writes config.json + model.safetensors and the tokenizer the checkpoint records, transformers
#      reloads both, and the greedy continuation of a prompt by transformers and by tools/generate.py's library
#      are compared.
#
#   bash examples/finetune_hf.sh                 # TRAIN_ITERS=30 NPROC=8 RUN_DIR=runs/finetune_hf
set -euo pipefail
cd "$(dirname "$0")/.."
MEGARESHARD_EXTRAS=${MEGARESHARD_EXTRAS:-hf} source tools/ensure_venv.sh   # transformers, safetensors

NPROC=${NPROC:-8}
TRAIN_ITERS=${TRAIN_ITERS:-30}
DOCS=${DOCS:-200}
RUN_DIR=${RUN_DIR:-runs/finetune_hf}
LAYOUT=${LAYOUT:-"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"}
PROMPT=${PROMPT:-"def "}
export WANDB_MODE=${WANDB_MODE:-disabled} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1
rm -rf "$RUN_DIR"; mkdir -p "$RUN_DIR"
export TMPDIR=$(mktemp -d -t megareshard-finetune-hf.XXXXXX)
trap 'rm -rf "$TMPDIR"' EXIT

echo "== 1. a tiny Llama and its tokenizer, made locally"
"$VENV_PY" examples/hf/make_tiny_llama.py "$RUN_DIR/hf_in" "$RUN_DIR/corpus.jsonl" --docs "$DOCS"
echo "== 2. tokenize the corpus with it"
"$VENV_PY" tools/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text --output-prefix "$RUN_DIR/data" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$RUN_DIR/hf_in" --append-eod --workers 1 | tail -2
echo "== 3. import it"
IMPORT=$("$VENV_PY" tools/checkpoint_util.py import-hf "$RUN_DIR/hf_in" "$RUN_DIR/imported")
echo "$IMPORT"
FLAGS=$(echo "$IMPORT" | sed -n 's/.*--finetune //p')
echo "== 4. fine-tune $TRAIN_ITERS iterations: $LAYOUT on $NPROC processes"
# --seq-length: half the tiny Llama's context (a fine-tune chooses its sequence length; the load warns nothing)
# shellcheck disable=SC2086
# shellcheck disable=SC2206
TRAIN_ARGS=($FLAGS $LAYOUT
    --load "$RUN_DIR/imported" --finetune --save "$RUN_DIR/finetuned"
    --data-path "$RUN_DIR/data_text_document" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$RUN_DIR/hf_in"
    --seq-length 64 --micro-batch-size 2 --global-batch-size 16 --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4
    --lr-decay-style cosine --lr-warmup-iters 2 --log-interval 5 --hidden-dropout 0 --attention-dropout 0
    --split 98,2,0 --device cpu)
# the arguments checked once, in this process, before the launcher (torchrun's arguments and agent; a failing
# rank in one line, with where its log is) starts a process per rank
WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$VENV_PY" pretrain_gpt.py --validate-only "${TRAIN_ARGS[@]}"
"$VENV_PY" -m megareshard.launch --standalone --nproc-per-node "$NPROC" --log-dir "$RUN_DIR/logs" \
    pretrain_gpt.py "${TRAIN_ARGS[@]}" 2>&1 \
    | tee "$RUN_DIR/finetune.log" | grep -E "megareshard:|megareshard-run:|: error:|iteration +[0-9]+/|checkpoint"
echo "== 5. export to Hugging Face, reload with transformers, generate with both"
"$VENV_PY" tools/checkpoint_util.py export-hf "$RUN_DIR/finetuned" "$RUN_DIR/hf_out"
"$VENV_PY" examples/hf/compare_generation.py "$RUN_DIR/hf_out" "$RUN_DIR/finetuned" "$PROMPT"
"$VENV_PY" tools/generate.py --load "$RUN_DIR/finetuned" --prompt "$PROMPT" --max-new-tokens 24 --top-p 0.9 \
    --temperature 0.8      # the tokenizer: the one the checkpoint records

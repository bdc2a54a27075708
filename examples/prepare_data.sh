#!/usr/bin/env bash
# Build (once, cached under $DATA_DIR) a BPE tokenizer and a tokenized dataset from a corpus
# every machine with Python has: the standard library's *.py sources.
#   DATA_DIR=data VOCAB=4096 bash examples/prepare_data.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/ensure_venv.sh
DATA_DIR=${DATA_DIR:-data}
VOCAB=${VOCAB:-4096}
mkdir -p "$DATA_DIR"
stdlib=$("$VENV_PY" -c 'import os; print(os.path.dirname(os.__file__))')
if [ ! -f "$DATA_DIR/tokenizer.model" ]; then
    echo "== training a $VOCAB-piece BPE tokenizer on $stdlib/*.py"
    "$VENV_PY" tools/train_tokenizer.py --input "$stdlib"/*.py --model-prefix "$DATA_DIR/tokenizer" --vocab-size "$VOCAB"
fi
if [ ! -f "$DATA_DIR/stdlib_text_document.idx" ]; then
    echo "== tokenizing $stdlib/*.py into $DATA_DIR/stdlib_text_document.{bin,idx}"
    "$VENV_PY" tools/preprocess_data.py --input "$stdlib"/*.py --tokenizer-model "$DATA_DIR/tokenizer.model" \
        --output-prefix "$DATA_DIR/stdlib" --append-eod --workers 2
fi

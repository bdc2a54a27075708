#!/usr/bin/env bash
# Create (or reuse) .venv, install megareshard with its test extra under the CPU
# constraints, run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# keep caches inside the tree (nothing written outside it but temp dirs)
export PIP_CACHE_DIR="$root/.venv/pip-cache"
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-cpu.txt -nt "$stamp" ]; then
    echo "[tests/run.sh] installing megareshard[test] into .venv (torch pinned by constraints-cpu.txt)"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
    touch "$stamp"
fi
tmp=$(mktemp -d -t megareshard-tests.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export WANDB_MODE=offline WANDB_DIR="$tmp/wandb" WANDB_CACHE_DIR="$tmp/wandb-cache" \
       WANDB_CONFIG_DIR="$tmp/wandb-config" TORCH_EXTENSIONS_DIR="$tmp/torch-ext" \
       MPLCONFIGDIR="$tmp/mpl" TMPDIR="$tmp"
exec .venv/bin/python -m pytest "$@"

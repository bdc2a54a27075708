#!/usr/bin/env bash
# Create (or reuse) .venv, install megareshard with its test extras under the CPU
# constraints, run the test suite (two workers). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# the test packages, deepspeed (the ZeRO peer), and what the examples the tests run need
MEGARESHARD_EXTRAS=test,deepspeed,megatron,plots,hf source tools/ensure_venv.sh
tmp=$(mktemp -d -t megareshard-tests.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# nothing is written outside the tree but this temp dir
export WANDB_MODE=offline WANDB_DIR="$tmp/wandb" WANDB_CACHE_DIR="$tmp/wandb-cache" \
       WANDB_CONFIG_DIR="$tmp/wandb-config" WANDB_DATA_DIR="$tmp/wandb-data" TORCH_EXTENSIONS_DIR="$tmp/torch-ext" \
       MPLCONFIGDIR="$tmp/mpl" TMPDIR="$tmp"
# Bytecode caches on (these machines set PYTHONDONTWRITEBYTECODE=1): the suite starts dozens of interpreters and
# forks hundreds of ranks that import the project's modules, each compiling them from source again without
# them (~0.3 CPU-s per interpreter), and pytest rewrites every test module's asserts in each worker. The caches
# are __pycache__/ directories inside the tree (ignored by git), compiled once before the workers start.
unset PYTHONDONTWRITEBYTECODE
"$VENV_PY" -m compileall -q -j 0 megareshard lab tests tools ./*.py > /dev/null
# Two workers (pytest-xdist), each taking whole files (a file's module fixtures, an 8-rank launch, run once):
# on 2 cores one worker alone leaves them idle while its tests start processes and wait on timeouts and
# peers. Files with a slow test start first (tests/conftest.py orders them; xdist's own reordering, most tests
# first, is off). MEGARESHARD_TEST_WORKERS=0 (or -n 0 among the arguments) runs it in one process.
"$VENV_PY" -m pytest -n "${MEGARESHARD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"

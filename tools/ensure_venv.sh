#!/usr/bin/env bash
# Source this: creates (or reuses) .venv at the repo root and installs megareshard[test] under the
# CPU constraints (torch==2.13.0; an unpinned torch pulls several GB of CUDA packages).
# Reinstalls only when pyproject.toml or constraints-cpu.txt changed. Sets $VENV_PY.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "[megareshard] creating $_root/.venv" >&2
    "${PYTHON:-python3}" -m venv "$_root/.venv"
fi
_stamp="$_root/.venv/.installed"
if [ ! -f "$_stamp" ] || [ "$_root/pyproject.toml" -nt "$_stamp" ] || [ "$_root/constraints-cpu.txt" -nt "$_stamp" ]; then
    echo "[megareshard] installing megareshard[test] into .venv (torch pinned by constraints-cpu.txt)" >&2
    PIP_CACHE_DIR="$_root/.venv/pip-cache" "$_root/.venv/bin/python" -m pip install -q --disable-pip-version-check \
        -c "$_root/constraints-cpu.txt" -e "$_root[test]"
    touch "$_stamp"
fi
VENV_PY="$_root/.venv/bin/python"

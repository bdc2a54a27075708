#!/usr/bin/env bash
# Source this: creates (or reuses) .venv at the repo root and installs megareshard[test,deepspeed,megatron]
# under the CPU constraints (torch==2.13.0; an unpinned torch pulls several GB of CUDA packages).
# deepspeed is the peer for the ZeRO tests (tests/test_deepspeed_peer.py); it installs without CUDA
# (no ops are prebuilt: DS_BUILD_OPS=0) and keeps torch at the pinned CPU build. megatron-core is the
# oracle of the Megatron-LM checkpoint tests; it needs only torch, numpy and packaging, so torch stays
# the pinned CPU build too.
# Reinstalls only when pyproject.toml, constraints-cpu.txt or this script changed. Sets $VENV_PY.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "[megareshard] creating $_root/.venv" >&2
    "${PYTHON:-python3}" -m venv "$_root/.venv"
fi
_stamp="$_root/.venv/.installed"
if [ ! -f "$_stamp" ] || [ "$_root/pyproject.toml" -nt "$_stamp" ] || [ "$_root/constraints-cpu.txt" -nt "$_stamp" ] \
        || [ "$_root/tools/ensure_venv.sh" -nt "$_stamp" ]; then
    echo "[megareshard] installing megareshard[test,deepspeed,megatron] into .venv (torch pinned by constraints-cpu.txt)" >&2
    DS_BUILD_OPS=0 PIP_CACHE_DIR="$_root/.venv/pip-cache" "$_root/.venv/bin/python" -m pip install -q --disable-pip-version-check \
        -c "$_root/constraints-cpu.txt" -e "$_root[test,deepspeed,megatron]"
    touch "$_stamp"
fi
VENV_PY="$_root/.venv/bin/python"

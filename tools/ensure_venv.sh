#!/usr/bin/env bash
# Source this: creates (or reuses) .venv at the repo root and installs megareshard with the extras named by
# MEGARESHARD_EXTRAS (comma-separated) under the CPU constraints (torch==2.13.0; an unpinned torch pulls several
# GB of CUDA packages). The default is what training and the examples' pictures need (`plots`); tests/run.sh
# asks for the test packages, deepspeed (the peer for the ZeRO tests, tests/test_deepspeed_peer.py: it
# installs without CUDA, DS_BUILD_OPS=0, and keeps torch at the pinned CPU build) and megatron-core (the oracle of
# the Megatron-LM checkpoint tests: it needs only torch, numpy and packaging, so torch stays the pinned CPU
# build too); the examples that import Hugging Face models ask for `hf`.
# Reinstalls only when pyproject.toml, constraints-cpu.txt or this script changed, or when an extra asked for
# is not installed yet (.venv/.installed lists those installed). Sets $VENV_PY.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_extras=${MEGARESHARD_EXTRAS:-plots}
if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "[megareshard] creating $_root/.venv" >&2
    "${PYTHON:-python3}" -m venv "$_root/.venv"
fi
_stamp="$_root/.venv/.installed"
_have=$(cat "$_stamp" 2>/dev/null || true)
_missing=""
for _e in ${_extras//,/ }; do
    case ",$_have," in *",$_e,"*) ;; *) _missing="$_missing $_e" ;; esac
done
if [ ! -f "$_stamp" ] || [ -n "$_missing" ] || [ "$_root/pyproject.toml" -nt "$_stamp" ] \
        || [ "$_root/constraints-cpu.txt" -nt "$_stamp" ] || [ "$_root/tools/ensure_venv.sh" -nt "$_stamp" ]; then
    # what is installed already stays: the union of the extras asked for now and before
    _all=$(printf '%s\n' ${_have//,/ } ${_extras//,/ } | awk 'NF && !seen[$0]++' | paste -sd, -)
    echo "[megareshard] installing megareshard[$_all] into .venv (torch pinned by constraints-cpu.txt)" >&2
    DS_BUILD_OPS=0 PIP_CACHE_DIR="$_root/.venv/pip-cache" "$_root/.venv/bin/python" -m pip install -q \
        --disable-pip-version-check -c "$_root/constraints-cpu.txt" -e "$_root[$_all]"
    echo "$_all" > "$_stamp"
fi
VENV_PY="$_root/.venv/bin/python"

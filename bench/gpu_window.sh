#!/usr/bin/env bash
# The headline GPU table in one command, sized to one borrowed GPU (15 minutes of machine time in all).
#
#   OUT=DIR bash bench/gpu_window.sh             # on the GPU machine, from the repository root
#   OUT=DIR bash bench/gpu_window.sh --dry_run   # every piece at tiny sizes on the CPU (a few minutes; no overall
#                                                # budget and five times each piece's cap: a busy CPU does not fail it)
#
# Installs the wheels of .whl/ (made here by `bash bench/prepare_gpu_wheels.sh`: what the GPU machine lacks)
# into a temporary folder, then runs bench/gpu_window.py: each piece under its own time cap, all within
# 400 s, writing $OUT/gpu_window.md and $OUT/gpu_window.json. PYTHON names the interpreter (default python3).
# Further arguments go to bench/gpu_window.py (--only PIECES, --budget SECONDS).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -z "${OUT:-}" ]; then
    echo "gpu_window.sh: set OUT to the folder the table goes to (OUT=DIR bash bench/gpu_window.sh)" >&2
    exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    SITE="$(mktemp -d)"
    trap 'rm -rf "$SITE"' EXIT
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        || { echo "gpu_window.sh: installing .whl/*.whl failed" >&2; exit 3; }
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" bench/gpu_window.py "$@"

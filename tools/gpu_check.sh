#!/usr/bin/env bash
# The checks that need a GPU, in at most 9 minutes including compilation: bash tools/gpu_check.sh [--parts a,b]
#
# Needs only this checkout and a python3 with a CUDA build of torch and Triton (PYTHON=... to choose
# another); it installs nothing. tools/gpu_check.py does the work: a preflight that names in one line
# whatever is missing and stops, then each part (tools/gpu_check.py PARTS) under its own timeout, every
# record appended to $OUT/gpu_check.jsonl (./gpu-results/ without OUT) as it is measured, a summary
# saying per target met or not, and $OUT/measured_costs.json: kvlib/course/data/measured_costs.json
# with this run's rows added, to commit. Triton's cache is .triton-cache/ here (ignored by git), so a
# rerun on a warm machine compiles nothing. Exit status: the number of parts that did not pass.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "kvlib GPU check: missing $PY (set PYTHON=...). Nothing was run."; exit 2; }
export TRITON_CACHE_DIR="$PWD/.triton-cache" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
exec "$PY" tools/gpu_check.py "$@"

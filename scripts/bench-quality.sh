#!/usr/bin/env bash
# Quality of each STAR-KV codec plan on a real model (SmolLM2-135M-Instruct, CPU, numpy):
# prints one JSON line per (plan, prefix length, text source) and writes the table into
# docs/quality.md between its TABLE markers. Needs scripts/eval-setup.sh and the pybind11
# module proxima_codec_py built by CMake (tools/eval/CMakeLists.txt) in $BUILD_DIR.
#
#   BUILD_DIR=build scripts/bench-quality.sh                 # full run (all plans, 512 and 2048)
#   scripts/bench-quality.sh --prefix 512 --windows 1 --plans int8   # quick look, no table
# Extra arguments go to `python3 -m proxima_eval eval` (see --help there). The table is written
# only by a run with the default arguments, so docs/quality.md never mixes runs. The JSON lines
# are also kept in $RESULTS (default: a temporary file); `python3 -m proxima_eval table` turns
# them into the table again.
# A full run is about an hour on 2 busy cores (OMP/OpenBLAS threads default to 2).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${BUILD_DIR:-build}"
SO="$(find "$BUILD_DIR" -name 'proxima_codec_py*.so' -print -quit 2>/dev/null || true)"
export PYTHONPATH="tools/eval${SO:+:$(dirname "$SO")}${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-2}"

REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git status --porcelain --untracked-files=no 2>/dev/null | head -c1)"
STARTED="$(date -u '+%Y-%m-%d %H:%M UTC')"
RESULTS="${RESULTS:-$(mktemp)}"

python3 -m proxima_eval eval --backend "${BACKEND:-kernels}" "$@" | tee "$RESULTS"

if [ "$#" -eq 0 ] && [ "${BACKEND:-kernels}" = kernels ]; then
  python3 -m proxima_eval table --doc docs/quality.md \
    --note "Measured by \`scripts/bench-quality.sh\` (default arguments), started $STARTED at commit $REV${DIRTY:+ (with uncommitted changes)}." \
    < "$RESULTS"
  echo "bench-quality: table written to docs/quality.md" >&2
fi

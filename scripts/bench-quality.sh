#!/usr/bin/env bash
# Quality of each STAR-KV codec plan on a real model (SmolLM2-135M-Instruct, CPU, numpy):
# prints one JSON line per (plan, prefix length, text source) and writes the table into
# docs/quality.md between its TABLE markers. Needs scripts/eval-setup.sh and the pybind11
# module proxima_codec_py built by CMake (tools/eval/CMakeLists.txt) in $BUILD_DIR.
#
#   BUILD_DIR=build scripts/bench-quality.sh                 # full run (all plans, 512 and 2048)
#   scripts/bench-quality.sh --prefix 512 --windows 1 --plans int8   # quick look
# Extra arguments go to `python3 -m proxima_eval eval` (see --help there).
# The table is written only by a run with the default plans and prefix lengths, so that
# docs/quality.md never mixes numbers from different runs.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${BUILD_DIR:-build}"
MOD_DIR="$(dirname "$(find "$BUILD_DIR" -name 'proxima_codec_py*.so' -print -quit 2>/dev/null)" 2>/dev/null || true)"
export PYTHONPATH="tools/eval${MOD_DIR:+:$MOD_DIR}${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-2}"

TABLE="$(mktemp)"
trap 'rm -f "$TABLE"' EXIT
ARGS=("$@")
python3 -m proxima_eval eval --backend "${BACKEND:-kernels}" --table "$TABLE" "${ARGS[@]}"

if [ "${#ARGS[@]}" -eq 0 ] && [ "${BACKEND:-kernels}" = kernels ]; then
  python3 - "$TABLE" docs/quality.md <<'PYEOF'
import datetime, subprocess, sys
table, doc = sys.argv[1], sys.argv[2]
rows = open(table).read()
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                     text=True).stdout.strip()
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
body = (f"Measured {stamp} at commit {rev} with `scripts/bench-quality.sh`.\n\n" + rows)
text = open(doc).read()
a, b = "<!-- BEGIN TABLE -->", "<!-- END TABLE -->"
i, j = text.index(a) + len(a), text.index(b)
open(doc, "w").write(text[:i] + "\n" + body + text[j:])
print(f"bench-quality: table written to {doc}", file=sys.stderr)
PYEOF
fi

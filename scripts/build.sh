#!/usr/bin/env bash
# Configures and builds Proxima into a build directory.
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# PROXIMA_TARGETS="a b" builds only those targets; PROXIMA_JOBS sets parallelism (default 2).
# Defaults: build/, RelWithDebInfo, CUDA AUTO (on when nvcc exists), tests and benchmarks on.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true
JOBS=${PROXIMA_JOBS:-2}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then GEN=(); fi
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "$@"
TARGETS=()
for t in ${PROXIMA_TARGETS:-}; do TARGETS+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" "${TARGETS[@]}"

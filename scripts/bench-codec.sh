#!/usr/bin/env bash
# Builds codec_bench in Release (its own build dir) and runs it; arguments go to the benchmark.
# Prints JSON lines (see bench/codec_bench.cc). With no --kv_file the data is synthetic and no
# error figures are printed.
#
#   scripts/bench-codec.sh --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv \
#       --working_set_mb=64
#
# Env: PROXIMA_BENCH_BUILD_DIR (default build-bench/ in the repo).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${PROXIMA_BENCH_BUILD_DIR:-$root/build-bench}
if [[ ! -f $build/build.ninja ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPROXIMA_BUILD_BENCH=ON \
    -DPROXIMA_BUILD_TESTS=OFF >&2
fi
ninja -C "$build" codec_bench >&2
echo "# cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) threads" >&2
exec "$build/bench/codec_bench" "$@"

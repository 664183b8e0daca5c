#!/usr/bin/env bash
# GPU checks, in two halves (the GPU machine has no package registry, so everything it runs is
# built here and carried there):
#
#   scripts/gpu-check.sh prepare   # here: Release build with CUDA into build-gpu/, plus the shared
#                                  # libraries the GPU binaries need, copied into build-gpu/lib
#   scripts/gpu-check.sh run       # there: runs the GPU tests (ctest label `gpu`, gtest binaries
#                                  # run directly) and the GPU codec benchmark; writes logs, JUnit
#                                  # XML and JSON lines to $OUT
#
#   scripts/gpu-check.sh vllm-e2e MODEL_DIR   # on a GPU host that reaches PyPI: vLLM end to end
#                                  # with the proxima connector (client/python/examples/vllm_e2e.py)
#
# With the device tool: run `prepare` here, then run with carry=["build-gpu"] and the command
# `scripts/gpu-check.sh run`. Without a GPU the tests skip (each prints why), so `run` also works
# here as a dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: scripts/gpu-check.sh prepare|run}
DIR=build-gpu
# The binaries that hold GPU tests (ctest label `gpu`), and the GPU benchmarks.
GPU_TESTS=(kernels/kernels_codec_cuda_test kernels/kernels_kv_layout_cuda_test daemon/daemon_test)
# gtest filter per binary (default: all of it): only the GPU-dependent tests of mixed binaries.
declare -A GPU_FILTER=([daemon/daemon_test]="TierServicePinTest.*")
GPU_BENCH=(bench/codec_gpu_bench)

case "$MODE" in
  prepare)
    ./scripts/install-deps.sh
    ./scripts/build.sh "$DIR" -DCMAKE_BUILD_TYPE=Release -DPROXIMA_WITH_CUDA=ON \
      -DPROXIMA_BUILD_BENCH=ON -DPROXIMA_BUILD_TESTS=ON
    mkdir -p "$DIR/lib"
    for t in "${GPU_TESTS[@]}" "${GPU_BENCH[@]}"; do
      ldd "$DIR/$t" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux)[.-]' |
        while read -r lib; do cp -Lu "$lib" "$DIR/lib/"; done
    done
    du -sh "$DIR/lib" "${GPU_TESTS[@]/#/$DIR/}" "${GPU_BENCH[@]/#/$DIR/}"
    ;;
  run)
    OUT=${OUT:-$PWD/gpu-check-out}
    mkdir -p "$OUT"
    export LD_LIBRARY_PATH="$PWD/$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    { nvidia-smi || echo "nvidia-smi not available"; } > "$OUT/device.txt" 2>&1
    status=0
    for t in "${GPU_TESTS[@]}"; do
      name=$(basename "$t")
      "$DIR/$t" --gtest_filter="${GPU_FILTER[$t]:-*}" --gtest_output="xml:$OUT/$name.xml" 2>&1 |
        tee "$OUT/$name.log" || status=1
    done
    # Kernels vs the device's own D2D copy bandwidth, on real KV, batches of 256 MiB.
    "$DIR/bench/codec_gpu_bench" --batch_mb=256 2>&1 | tee "$OUT/codec_gpu_bench.jsonl" || status=1
    exit $status
    ;;
  vllm-e2e)
    # vLLM on a GPU with the proxima connector, the same prompts in two fresh engines: the second
    # must load prefix KV from proximad and produce the same greedy text. Not run on the device
    # tool's machine: vLLM and torch (GBs) cannot be carried there, and it reaches no registry.
    MODEL_DIR=${2:?usage: scripts/gpu-check.sh vllm-e2e MODEL_DIR}
    VENV=${VENV:-.venv-engines}
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "vllm==0.33.0"
    PROXIMA_TARGETS="proximad _proxima proxima_codec_py" ./scripts/build.sh build
    PROXIMA_BUILD_DIR=build "$VENV/bin/python" -m pip install -q ./client/python
    SOCK=$(mktemp -d)/proximad.sock
    build/daemon/proximad --set=server.unix_socket="$SOCK" --set=server.listen= \
      --set=server.metrics_listen= --set=tiers.host.capacity_bytes=8GiB &
    DAEMON=$!
    trap 'kill $DAEMON' EXIT
    for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
    PYTHONHASHSEED=0 "$VENV/bin/python" client/python/examples/vllm_e2e.py \
      --model "$MODEL_DIR" --target "unix:$SOCK"
    ;;
  *) echo "unknown mode '$MODE' (prepare | run | vllm-e2e)" >&2; exit 2 ;;
esac

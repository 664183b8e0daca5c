#!/usr/bin/env bash
# GPU checks, in two halves (the GPU machine has no package registry, so everything it runs is
# built here and carried there):
#
#   scripts/gpu-check.sh prepare   # here: a CUDA build (Release into build-gpu-src/, or the
#                                  # existing build named by FROM=DIR), then a bundle in build-gpu/:
#                                  # the GPU test and benchmark binaries, stripped, and the shared
#                                  # libraries they need (build-gpu/lib)
#   scripts/gpu-check.sh run       # there: runs the GPU tests (gtest binaries, `gpu` ctest label),
#                                  # the GPU benchmarks, compute-sanitizer over the kernel tests and
#                                  # a proximad start that must find the GPU; a summary on stdout,
#                                  # every log, JUnit XML and JSON line in $OUT/gpu-check.tgz
#
#   scripts/gpu-check.sh profile   # there: Nsight Compute over the STAR-KV kernels (decode, fused
#                                  # encode, CRC pass) per codec; text reports in $OUT/profile.tgz
#
#   scripts/gpu-check.sh vllm-e2e MODEL_DIR   # on a GPU host that reaches PyPI: vLLM end to end
#                                  # with the proxima connector (client/python/examples/vllm_e2e.py)
#
# With the device tool: run `prepare` here, then run with carry=["build-gpu-pack"] (the bundle
# packed: build-gpu/ itself is over the tool's 64 MiB) and the command `scripts/gpu-check.sh run`,
# which unpacks it. Without a GPU the tests skip (each prints why), so `run` also works here as a
# dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: scripts/gpu-check.sh prepare|run|profile|vllm-e2e}
DIR=build-gpu
PACK=build-gpu-pack/build-gpu.tgz
# The binaries that hold GPU tests (ctest label `gpu`), and the GPU benchmarks.
GPU_TESTS=(kernels/kernels_device_test kernels/kernels_codec_cuda_test
  kernels/kernels_kv_layout_cuda_test kernels/kernels_crc32c_cuda_test daemon/daemon_test
  tests/integration/gpu_staging_test tests/integration/integration_test
  tests/integration/cluster_integration_test)
# gtest filter per binary (default: all of it): only the GPU-dependent tests of mixed binaries
# (the GPU tier's run over the stand-in too: the same tests, side by side with the CUDA ones).
declare -A GPU_FILTER=([daemon/daemon_test]="TierServicePinTest.*:*GpuTier*"
  [tests/integration/integration_test]="TiersTest.AConfiguredGpuTier*:*SnapshotKeepsTheGpuTier*"
  [tests/integration/cluster_integration_test]="*GpuTier*")
GPU_BENCH=(bench/codec_gpu_bench bench/kv_layout_bench bench/crc32c_gpu_bench bench/gpu_tier_bench)
# The codec's CPU paths are checked and timed on the GPU machine's CPU too (another CPU model
# than the build machines': AVX-512 on an Intel or AMD server part).
CPU_SIMD=(kernels/kernels_simd_test bench/codec_bench)
# The UCX data plane on a machine with more than two cores (build machines: 2), against
# ucx_perftest and Redis, whose Debian binaries travel in $DIR/bin.
OTHER=(daemon/proximad tools/proximactl/proximactl "${CPU_SIMD[@]}" bench/transfer_bench)
SYSTEM_BINS=(/usr/bin/ucx_perftest /usr/bin/redis-server)

# On the GPU machine: logs go to a fresh $LOGS, packed into $OUT/$1 when the script exits, and
# the carried shared libraries come first.
start_logs() {
  OUT=${OUT:-$PWD/gpu-check-out}
  LOGS=$(mktemp -d)
  mkdir -p "$OUT"
  trap "tar czf '$OUT/$1' -C '$LOGS' . ; rm -rf '$LOGS'" EXIT
  export LD_LIBRARY_PATH="$PWD/$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

case "$MODE" in
  prepare)
    SRC=${FROM:-build-gpu-src}
    if [ -z "${FROM:-}" ]; then
      ./scripts/install-deps.sh
      ./scripts/build.sh "$SRC" -DCMAKE_BUILD_TYPE=Release -DPROXIMA_WITH_CUDA=ON \
        -DPROXIMA_BUILD_BENCH=ON -DPROXIMA_BUILD_TESTS=ON
    else
      PROXIMA_TARGETS="${GPU_TESTS[*]##*/} ${GPU_BENCH[*]##*/} ${OTHER[*]##*/}" \
        ./scripts/build.sh "$SRC"
    fi
    compgen -G "$SRC/CMakeFiles/*/CMakeCUDACompiler.cmake" >/dev/null ||
      { echo "gpu-check: $SRC was configured without CUDA" >&2; exit 1; }
    rm -rf "$DIR" && mkdir -p "$DIR/lib"
    for t in "${GPU_TESTS[@]}" "${GPU_BENCH[@]}" "${OTHER[@]}"; do
      mkdir -p "$DIR/$(dirname "$t")"
      objcopy --strip-debug "$SRC/$t" "$DIR/$t"
      ldd "$SRC/$t" | awk '/=> \// {print $3}' |
        grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s|ld-linux)[.-]' |
        while read -r lib; do cp -Lu "$lib" "$DIR/lib/"; done
    done
    mkdir -p "$DIR/bin"
    for b in "${SYSTEM_BINS[@]}"; do
      # redis-server is a link to redis-check-rdb, which picks its role from its name.
      cp -L "$b" "$DIR/bin/$(basename "$b")"
      ldd "$b" | awk '/=> \// {print $3}' |
        grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s|ld-linux)[.-]' |
        while read -r lib; do cp -Lu "$lib" "$DIR/lib/"; done
    done
    # The Python binding for the GPU machine's interpreter (GPU_CHECK_PYTHON, a python3 of the
    # same minor version as the one there: 3.12), so that the package's torch CUDA tests
    # (client/python/tests/test_cuda.py) run there: binding.cc compiled as the build compiles it,
    # against that Python's headers and pybind11 (pip-installed into it), linked like the build
    # links it. Skipped when GPU_CHECK_PYTHON is unset.
    if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
      "$GPU_CHECK_PYTHON" -m pip install -q "pybind11>=2.12"
      PYINC=$("$GPU_CHECK_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
      PBINC=$("$GPU_CHECK_PYTHON" -c 'import pybind11; print(pybind11.get_include())')
      SUFFIX=$("$GPU_CHECK_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
      HOSTSUFFIX=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
      PROXIMA_TARGETS="_proxima" ./scripts/build.sh "$SRC"
      compile=$(ninja -C "$SRC" -t commands "client/python/_proxima$HOSTSUFFIX" | grep 'binding.cc.o -c')
      link=$(ninja -C "$SRC" -t commands "client/python/_proxima$HOSTSUFFIX" | tail -1)
      obj=$PWD/$SRC/gpu-check-binding.o
      mkdir -p "$DIR/py/proxima"
      compile=$(echo "$compile" | sed -E "s#-isystem [^ ]*/include/python3[^ ]*#-isystem $PYINC -isystem $PBINC#; s#-MD -MT [^ ]* -MF [^ ]*##; s#-o [^ ]*binding.cc.o#-o $obj#")
      link=$(echo "$link" | sed -E "s#^: && ##; s# && :\$##; s#client/python/CMakeFiles/_proxima.dir/binding.cc.o#$obj#; s#-o [^ ]*_proxima[^ ]*\.so#-o $PWD/$DIR/py/proxima/_proxima$SUFFIX#")
      (cd "$SRC" && eval "$compile" && eval "$link")
      strip --strip-debug "$DIR/py/proxima/_proxima$SUFFIX"
      cp client/python/proxima/*.py "$DIR/py/proxima/"
    fi
    du -sh "$DIR"
    mkdir -p "$(dirname "$PACK")"
    tar czf "$PACK" "$DIR"
    du -sh "$PACK"
    ;;
  run)
    [ -d "$DIR" ] || tar xzf "$PACK"
    start_logs gpu-check.tgz
    export PROXIMAD="$PWD/$DIR/daemon/proximad"  # for the tests that start the daemon
    # Real KV for the tests (they were built with this checkout's path compiled in).
    export PROXIMA_TEST_KV_FILE="$PWD/tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv"
    # The codec_encode fuzz corpus, which CodecCudaTest replays through the GPU.
    export PROXIMA_FUZZ_CORPUS_ROOT="$PWD/tests/fuzz/corpus"
    { nvidia-smi || echo "nvidia-smi not available"; nvcc --version || true
      grep -m1 'model name' /proc/cpuinfo
      { grep -o -w 'avx512[a-z0-9_]*' /proc/cpuinfo || echo "no avx512"; } | sort -u | tr '\n' ' '
      echo; } > "$LOGS/device.txt" 2>&1
    head -15 "$LOGS/device.txt"; tail -2 "$LOGS/device.txt"
    status=0
    step() {  # step NAME SECONDS CMD...: runs CMD under a time limit, log in $LOGS/NAME.log
      local name=$1 limit=$2; shift 2
      # GPU_CHECK_SKIP="name ..." leaves steps out (to spare device time on a rerun).
      if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped"; return; fi
      local t0=$SECONDS rc=0
      timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
      echo "== $name: rc=$rc in $((SECONDS - t0)) s"
      grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|ERROR SUMMARY|"metric"|"skipped"|error|Error' \
        "$LOGS/$name.log" | head -40 || true
      [ "$rc" = 0 ] || status=1
    }
    for t in "${GPU_TESTS[@]}"; do
      name=$(basename "$t")
      step "$name" 240 "$DIR/$t" --gtest_filter="${GPU_FILTER[$t]:-*}" \
        --gtest_output="xml:$LOGS/$name.xml"
    done
    # Kernels vs the device's own D2D copy bandwidth, on real KV, batches of 256 MiB.
    step codec_gpu_bench 180 "$DIR/bench/codec_gpu_bench" --batch_mb=256 \
      --codecs="fp8;int8;int4;int2;star;k4v3,rope_theta=100000"
    step crc32c_gpu_bench 60 "$DIR/bench/crc32c_gpu_bench" --batch_mb=256 --span_kb=700
    step kv_layout_gpu_bench 120 "$DIR/bench/kv_layout_bench" --device=cuda --num_blocks=256 \
      --batch=64
    # The GPU tier's put, get and move down (raw, and encoded on the GPU) vs the device's copies.
    step gpu_tier_bench 120 "$DIR/bench/gpu_tier_bench" \
      --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv --pool_mb=1024 \
      --levels="${GPU_TIER_LEVELS:-raw;int8;int4}"
    # The CPU codec paths on this machine's CPU: bit identity of every path it has (AVX-512 here
    # when the CPU has it) and their speed against memcpy, one thread.
    step cpu-simd-test 120 "$DIR/kernels/kernels_simd_test"
    step cpu-codec-bench 240 "$DIR/bench/codec_bench" \
      --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv --min_time_s=0.3 \
      --threads=1 --working_set_mb=64 --codecs="fp8;int8;int4,group=64;int2,group=64" \
      --paths=avx512,avx2,scalar
    # The UCX data plane with more cores than the build machines have: shared memory (the
    # daemon copies mapped segments on its gRPC threads) and tcp, 1-8 clients, against
    # ucx_perftest and Redis measured in the same run (issue 5's goals).
    step transfer-bench 240 "$DIR/bench/transfer_bench" --proximad="$PWD/$DIR/daemon/proximad" \
      --ucx_perftest="$PWD/$DIR/bin/ucx_perftest" --redis_server="$PWD/$DIR/bin/redis-server" \
      --transports="posix+self,tcp" --sizes=2097152,16777216 --clients=1,4,8 \
      --bytes_per_client=134217728 --latency_gets=100 --buffers=ucx,heap
    # The Python package with torch on the GPU (the vLLM connector's GPU half), when prepare
    # built the binding for this machine's python3. The carried libstdc++ stays out of the way of
    # the one torch was built against.
    if compgen -G "$DIR/py/proxima/_proxima*.so" >/dev/null; then
      PYLIB=$(mktemp -d)
      for l in "$DIR"/lib/*; do
        case "$(basename "$l")" in libstdc++*) ;; *) ln -s "$PWD/$l" "$PYLIB/" ;; esac
      done
      step python-cuda 120 env LD_LIBRARY_PATH="$PYLIB" PYTHONPATH="$PWD/$DIR/py" \
        PROXIMAD="$PWD/$DIR/daemon/proximad" PROXIMA_BUILD_DIR="$PWD/$DIR/none" \
        python3 -m pytest -q -rs -p no:cacheprovider client/python/tests/test_cuda.py
      tail -5 "$LOGS/python-cuda.log"
    fi
    # proximad on its default config must report the GPU it found, then drain on SIGTERM.
    probe() {
      "$DIR/daemon/proximad" --set=server.listen=127.0.0.1:0 --set=server.metrics_listen= &
      local pid=$!
      sleep 3
      kill -TERM "$pid"
      wait "$pid"
    }
    step proximad-start 30 bash -c "$(declare -f probe); DIR=$DIR; probe"
    [ -f "$LOGS/proximad-start.log" ] && { grep -iE 'gpu|cuda' "$LOGS/proximad-start.log" | head -5 || true; }
    # The GPU tier end to end: proximad with a 16 MiB pool on each GPU; 200 blocks of 256 KiB
    # put and got back through proximactl, every byte checked, so that most of them move down
    # from the pool to the host tier; the stats must show the pool and the metrics the moves.
    gpu_tier() {
      local dir pid rc=0
      dir=$(mktemp -d)
      "$DIR/daemon/proximad" --set=server.listen= --set=server.metrics_listen=127.0.0.1:0 \
        --port_file="$dir/ports.json" --set="server.unix_socket=$dir/s" \
        --set=tiers.gpu.capacity_bytes_per_device=16MiB &
      pid=$!
      for _ in $(seq 100); do [ -s "$dir/ports.json" ] && break; sleep 0.1; done
      local ctl="$DIR/tools/proximactl/proximactl" t="--target=unix:$dir/s"
      "$ctl" put "$t" --seed=3 --count=200 || rc=1
      "$ctl" get "$t" --seed=3 --count=200 --json | tee "$dir/get.json"
      grep -q '"ok":true' "$dir/get.json" && grep -q '"misses":0' "$dir/get.json" || rc=1
      "$ctl" stats "$t" | tee "$dir/stats.txt"
      grep -q '^gpu:0' "$dir/stats.txt" || rc=1
      local port
      port=$(sed -E 's/.*"metrics_port":([0-9]+).*/\1/' "$dir/ports.json")
      curl -s "http://127.0.0.1:$port/metrics" | grep -E '^proxima_(tierer_gpu|tier_(used|capacity)_bytes)'
      kill -TERM "$pid"
      wait "$pid" || rc=1
      rm -rf "$dir"
      return $rc
    }
    step gpu-tier 90 bash -c "$(declare -f gpu_tier); DIR=$DIR; gpu_tier"
    # Out-of-bounds accesses and races in the kernels (Firecracker machines run compute-sanitizer),
    # last: the slowest steps, so a run cut short by its time limit still has the rest.
    if command -v compute-sanitizer >/dev/null; then
      for t in kernels/kernels_kv_layout_cuda_test kernels/kernels_codec_cuda_test \
        kernels/kernels_crc32c_cuda_test; do
        step "memcheck-$(basename "$t")" 150 compute-sanitizer --tool memcheck \
          --error-exitcode 3 "$DIR/$t"
      done
      for t in kernels/kernels_kv_layout_cuda_test kernels/kernels_codec_cuda_test; do
        step "racecheck-$(basename "$t")" 150 compute-sanitizer --tool racecheck \
          --error-exitcode 3 "$DIR/$t"
      done
    fi
    exit $status
    ;;
  profile)
    [ -d "$DIR" ] || tar xzf "$PACK"
    # Nsight Compute over one launch of each STAR-KV kernel (decode, fused encode, the CRC pass)
    # per codec, on real KV through codec_gpu_bench: speed of light, occupancy, warp stalls and
    # memory traffic, as text in $OUT/profile.tgz (a summary of each on stdout). PROFILE_CODECS
    # and PROFILE_KERNELS override the codecs and the kernels.
    start_logs profile.tgz
    command -v ncu >/dev/null || { echo "gpu-check: ncu not found" >&2; exit 1; }
    SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats
      --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
    for codec in ${PROFILE_CODECS:-fp8 int8 int4}; do
      for kernel in ${PROFILE_KERNELS:-DecodeVecsKernel EncodeHeadsKernel ChunkKernel}; do
        log="$LOGS/ncu-$codec-$kernel.txt"
        timeout 120 ncu --clock-control none -k "regex:$kernel" -c 1 "${SECTIONS[@]}" \
          "$DIR/bench/codec_gpu_bench" --batch_mb=128 --codecs="$codec" > "$log" 2>&1 || true
        echo "== $codec $kernel"
        grep -E 'Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|No Eligible|Active Warps Per' "$log" | head -14 || true
      done
    done
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
  *) echo "unknown mode '$MODE' (prepare | run | profile | vllm-e2e)" >&2; exit 2 ;;
esac

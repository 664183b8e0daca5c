#!/usr/bin/env bash
# Proxima cross-built for aarch64 (Grace / GH200 nodes) and run under qemu-aarch64:
#   1. a sysroot of Debian's arm64 packages (gRPC, protobuf, UCX, yaml-cpp, jemalloc, OpenSSL,
#      Abseil, GoogleTest and what they need), downloaded and unpacked into build-aarch64-sysroot/
#      (nothing arm64 is installed into the host; apt only learns the arm64 package lists);
#   2. proximad, proximactl, every unit-test binary and the integration tests of integration_test
#      and ucx_integration_test, built with Debian's aarch64 compiler into build-aarch64/ (no
#      CUDA, no benchmarks);
#   3. the unit tests under qemu (the recorded encodings of kernels/testdata/golden_encodings.txt
#      included: blocks encode to the same bytes as on x86), then the README demo's workload
#      (put, lookup, byte-checked get, load, stats, SIGTERM) against the aarch64 proximad, with
#      the aarch64 proximactl, both under qemu;
#   4. those integration tests but four (named below), whose test binaries start proximad and
#      proximactl through qemu themselves (no binfmt_misc here). The cluster, corruption and
#      replay integration tests are not built for aarch64.
# Needs root (or sudo) for apt-get. PROXIMA_SKIP_AARCH64=1 skips all of it, saying so.
#
# Usage: scripts/aarch64.sh [all|setup|build|test]. `all` (the default) is the three in order:
# `setup` is 1 (apt-get and downloads: run it alone, never beside another apt-get), `build` is 2,
# `test` is 3 and 4 (it builds first whatever `build` has not). scripts/test.sh runs `build` in
# the background while the native tests run, and `test` after them.
set -euo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
case "$PHASE" in
  all | setup | build | test) ;;
  *) echo "usage: scripts/aarch64.sh [all|setup|build|test] (got '$PHASE')" >&2; exit 2 ;;
esac
if [ "${PROXIMA_SKIP_AARCH64:-0}" = 1 ]; then
  echo "aarch64: SKIPPED (PROXIMA_SKIP_AARCH64=1): nothing was built or tested for aarch64"
  exit 0
fi
BUILD_DIR=build-aarch64
SYSROOT=$PWD/build-aarch64-sysroot
SUDO=()
[ "$(id -u)" -ne 0 ] && SUDO=(sudo)
DEV_PKGS="libgrpc++-dev libprotobuf-dev libyaml-cpp-dev libucx-dev libjemalloc-dev libssl-dev
  libabsl-dev libgtest-dev libgmock-dev libc6-dev libstdc++-12-dev"
STAMP="$SYSROOT/.complete"

setup() {
# --- host tools: the cross compiler and qemu (x86 packages)
need_apt=0
for p in g++-aarch64-linux-gnu qemu-user; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt=1
done
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  "${SUDO[@]}" dpkg --add-architecture arm64  # apt then fetches the arm64 package lists
  need_apt=1
fi
if [ "$need_apt" = 1 ]; then
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    g++-aarch64-linux-gnu qemu-user >/dev/null
fi

# --- the sysroot (kept between runs; remade when DEV_PKGS changes)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$(echo $DEV_PKGS)" ]; then
  rm -rf "$SYSROOT"
  mkdir -p "$SYSROOT/.debs"
  # The arm64 packages these need, recursively (virtual packages, in <>, are left out).
  mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances \
    $(for p in $DEV_PKGS; do echo "$p:arm64"; done) | grep -E '^[a-z0-9][^ ]*:arm64$' | sort -u)
  # (apt warns that root downloads unsandboxed; that line is dropped, any other error shows.)
  (cd "$SYSROOT/.debs" && apt-get download -qq "${closure[@]}" 2> >(grep -v unsandboxed >&2))
  [ "$(ls "$SYSROOT"/.debs/*.deb | wc -l)" -eq "${#closure[@]}" ] ||
    { echo "aarch64: downloaded $(ls "$SYSROOT"/.debs | wc -l) of ${#closure[@]} packages" >&2; exit 1; }
  for deb in "$SYSROOT"/.debs/*.deb; do dpkg -x "$deb" "$SYSROOT"; done
  rm -rf "$SYSROOT/.debs"
  # Absolute symlinks (libz.so -> /lib/aarch64-linux-gnu/...) must point inside the sysroot.
  find "$SYSROOT" -type l -lname '/*' -print0 | while IFS= read -r -d '' link; do
    ln -sfn "$SYSROOT$(readlink "$link")" "$link"
  done
  # gRPC's CMake package checks that its code generators exist at their installed paths; the
  # build runs the host's grpc_cpp_plugin (found on PATH), the others are never run.
  mkdir -p "$SYSROOT/usr/bin"
  for tool in $(grep -oh '_IMPORT_PREFIX}/bin/[a-z_]*' \
                  "$SYSROOT"/usr/lib/aarch64-linux-gnu/cmake/grpc/gRPCTargets-*.cmake |
                sed 's|.*/bin/||' | sort -u); do
    printf '#!/bin/sh\necho "%s: the arm64 package'"'"'s tool is not run here" >&2; exit 1\n' \
      "$tool" > "$SYSROOT/usr/bin/$tool"
    chmod +x "$SYSROOT/usr/bin/$tool"
  done
  echo $DEV_PKGS > "$STAMP"
fi
}

export PROXIMA_AARCH64_SYSROOT=$SYSROOT

build() {
[ -f "$STAMP" ] || { echo "aarch64: no sysroot in $SYSROOT: run scripts/aarch64.sh setup" >&2; exit 1; }
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then GEN=(); fi
# -O2 as on x86, with line tables only (-g1): a failure under qemu still names file and line, and
# the libraries compile about a fifth faster than with full debug information (CI's time).
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DPROXIMA_WITH_CUDA=OFF -DPROXIMA_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" >/dev/null
# Not tools/replay's and tools/sim's tests: offline tools (trace replay, placement simulation)
# that run on a workstation, not on a node; their 44 s under qemu were trace parsing.
UNIT_TESTS=(common_test ucx_test wire_test daemon_test fuzz_corpus_test
            kernels_device_test kernels_codec_test kernels_simd_test kernels_vec_codec_test
            kernels_kv_layout_test kernels_crc32c_math_test kernels_codec_cuda_test
            kernels_kv_layout_cuda_test kernels_crc32c_cuda_test)
# Integration tests that start the aarch64 proximad and proximactl themselves, through qemu.
INTEGRATION_TESTS=(integration_test ucx_integration_test)
cmake --build "$BUILD_DIR" -j "${PROXIMA_JOBS:-2}" --target proximad proximactl "${UNIT_TESTS[@]}" \
  "${INTEGRATION_TESTS[@]}"
readelf -h "$BUILD_DIR/daemon/proximad" | grep -q "Machine: *AArch64" ||
  { echo "aarch64: $BUILD_DIR/daemon/proximad is not an aarch64 binary" >&2; exit 1; }
}

run_tests() {
# --- unit tests under qemu (qemu's CPU has the CRC32 extension: require the CRC32C tests to have
# run the instruction path)
# Left out: snapshot_disk_full, which execs the test binary directly under unshare (the kernel
# cannot run it here; see ucx_namespaces_apart below); what it tests (a snapshot write on a full
# file system) does not depend on the architecture, and it runs natively in the main suite.
PROXIMA_EXPECT_HW_CRC32C=1 ctest --test-dir "$BUILD_DIR" -L unit --output-on-failure \
  -j "${PROXIMA_JOBS:-2}" --timeout 600 -E '^snapshot_disk_full$'

# --- the demo's workload against the aarch64 daemon
PROXIMA_DEMO_PREBUILT="$BUILD_DIR" PROXIMA_DEMO_RUNNER="qemu-aarch64 -L $SYSROOT" ./scripts/demo.sh

# --- integration tests: the aarch64 test binaries start the aarch64 proximad and proximactl
# themselves, through qemu (PROXIMA_TEST_RUNNER, tests/integration/daemon_process.cc): real
# daemon processes on loopback, gRPC over TCP and Unix sockets, UCX over tcp and shared memory,
# the tierer's compression, bad input, tokens and TLS. Left out, and why:
#   UcxProbeTest: its premise is a client whose UCX registers memory with cma, which the daemon
#     (tcp only) cannot reach; under qemu-user the probe read succeeds (UCX does not end up on
#     cma there), so the mismatch it tests does not arise;
#   SigtermDrains..., SigkillMidBatches...: they need calls to be in flight at the instant of the
#     signal and to fail within short deadlines, which emulation speed (10-30x slower) breaks;
#   RawUcxTest.ConnectDisconnectCyclesLeakNothing: 10,000 UCX connections opened and closed, 110 s
#     (shm) and 36 s (tcp) under qemu, over a third of this step's test time; what it checks (every
#     endpoint and registration released) is the daemon's bookkeeping, the same code on both
#     architectures, and it runs natively in the main suite.
#   RawUcxTest.LyingWorkerAddresses...: under qemu proximad cannot run itself to check worker
#     addresses in a child (tests/integration/daemon_process.cc turns ucx.check_worker_addresses
#     off), so a lying address ends the daemon as the check exists to prevent;
#   PosixKeyModes/RawUcxTest.*: the raw cases again with UCX_POSIX_USE_PROC_LINK=n (posix keys
#     that name segments by shm_open name and by a file in a directory); which way a key names
#     its segment does not depend on the architecture, and the cases run natively in the main
#     suite (the transports' own cases, Transports/RawUcxTest.*, run here);
#   UcxNamespaceTest, ucx_namespaces_apart: a daemon and a client in different PID and IPC
#     namespaces (unshare); the second execs the test binary directly, which the kernel cannot
#     run here, and what they test (which parts of a memory key a client sends) does not depend
#     on the architecture; they run natively in the main suite;
#   snapshot_disk_full_daemon: as snapshot_disk_full above (a daemon's snapshot on a full disk);
#   OutOfDescriptorsTheMetricsListenerWaitsInsteadOfSpinning: it bounds the CPU time an idle
#     daemon uses, which emulation multiplies; the loop it checks is the same code natively;
#   cluster_over_tcp: it runs cluster_integration_test, which is not built here (like every
#     cluster test, it runs natively in the main suite).
# The scripts registered under the label (Python, the replay and restart benchmarks, the soaks)
# are x86 only.
PROXIMA_TEST_RUNNER="$(command -v qemu-aarch64) -L $SYSROOT" ctest --test-dir "$BUILD_DIR" \
  -L integration --output-on-failure -j "${PROXIMA_JOBS:-2}" --timeout 600 \
  -E '^(python_pytest|replay_bench_quick|restart_bench_quick|soak_.*|cluster_over_tcp)$|UcxProbeTest|SigtermDrainsInFlightCalls|SigkillMidBatchesFailsFast|ConnectDisconnectCyclesLeakNothing|LyingWorkerAddresses|^PosixKeyModes/|UcxNamespaceTest|^ucx_namespaces_apart$|^snapshot_disk_full_daemon$|OutOfDescriptorsTheMetricsListenerWaits'
echo "aarch64: proximad, proximactl, the unit tests and the integration tests ran under qemu-aarch64"
}

case "$PHASE" in
  setup) setup ;;
  build) build ;;
  test) build; run_tests ;;
  all) setup; build; run_tests ;;
esac

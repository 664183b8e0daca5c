#!/usr/bin/env bash
# The codec library (proxima_common + proxima_kernels) built for aarch64 and its unit tests run
# under qemu-aarch64: the CPU path of an ARM node (Grace, GH200) is the scalar reference, and
# blocks must encode and decode to the same bytes there as on x86 (docs/decisions.md).
#   scripts/aarch64.sh            install what it needs, build build-aarch64/, run the tests
# Needs root for apt-get (adds the arm64 architecture to dpkg for the cross libraries).
# PROXIMA_SKIP_AARCH64=1 skips it, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${PROXIMA_SKIP_AARCH64:-0}" = 1 ]; then
  echo "aarch64: SKIPPED (PROXIMA_SKIP_AARCH64=1): the codec was not built or tested for aarch64"
  exit 0
fi
BUILD_DIR=${1:-build-aarch64}
pkgs=(g++-aarch64-linux-gnu qemu-user libabsl-dev:arm64 libgtest-dev:arm64 libgmock-dev:arm64
      libssl-dev:arm64)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=()
  [ "$(id -u)" -ne 0 ] && SUDO=(sudo)
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    "${SUDO[@]}" dpkg --add-architecture arm64
  fi
  "${SUDO[@]}" apt-get update -qq
  # The host's libssl-dev must be the same version as the arm64 one (multiarch): both move.
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" libssl-dev >/dev/null
fi
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then GEN=(); fi
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DPROXIMA_KERNELS_ONLY=ON -DPROXIMA_WITH_CUDA=OFF -DPROXIMA_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j "${PROXIMA_JOBS:-2}"
readelf -h "$BUILD_DIR/kernels/kernels_codec_test" | grep -q "Machine: *AArch64" ||
  { echo "aarch64: $BUILD_DIR/kernels/kernels_codec_test is not an aarch64 binary" >&2; exit 1; }
# qemu's CPU has the CRC32 extension: require the CRC32C tests to have run the instruction path.
PROXIMA_EXPECT_HW_CRC32C=1 ctest --test-dir "$BUILD_DIR" --output-on-failure \
  -j "${PROXIMA_JOBS:-2}" --timeout 600

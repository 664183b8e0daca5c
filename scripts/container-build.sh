#!/usr/bin/env bash
# The container image's build recipe (deploy/Dockerfile runs it), kept as a script so that the
# test suite exercises the same steps on a machine without a container engine
# (tests/deploy/test_deploy.py).
#
#   scripts/container-build.sh deps                      apt-get the build dependencies
#   scripts/container-build.sh build BUILD_DIR PREFIX    build proximad + proximactl, install to PREFIX
#   scripts/container-build.sh runtime-packages PREFIX   print the Debian/Ubuntu packages that own
#                                                        the shared libraries the installed
#                                                        binaries load (what the runtime stage needs)
#
# Layout under PREFIX (the image uses PREFIX=/usr/local):
#   bin/proximad, bin/proximactl, etc/proxima/proxima.yaml (deploy/config/proxima.yaml)
# Environment: PROXIMA_WITH_CUDA (default AUTO: CUDA kernels when nvcc is present, as in the
# image's CUDA devel stage), PROXIMA_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '5,12p' "$0" >&2; exit 2; }

cmd=${1:-}
case "$cmd" in
  deps)
    # Build dependencies only (no test, benchmark or Redis packages): what the image's builder
    # stage needs. Package names exist in Debian 12 and Ubuntu 24.04 alike.
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
      build-essential cmake ninja-build pkg-config ca-certificates \
      libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev \
      libabsl-dev libucx-dev libjemalloc-dev libyaml-cpp-dev
    ;;
  build)
    [ $# -eq 3 ] || usage
    build_dir=$2
    prefix=$3
    # A fresh tree is configured for the image; an existing one (the test suite passes the
    # project's own build/) is left as configured and only brought up to date.
    if [ ! -f "$build_dir/CMakeCache.txt" ]; then
      cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DPROXIMA_WITH_CUDA="${PROXIMA_WITH_CUDA:-AUTO}" -DPROXIMA_BUILD_TESTS=OFF \
        -DPROXIMA_BUILD_BENCH=OFF
    fi
    cmake --build "$build_dir" -j "${PROXIMA_JOBS:-2}" --target proximad proximactl
    install -d "$prefix/bin" "$prefix/etc/proxima"
    install -m 0755 "$build_dir/daemon/proximad" "$prefix/bin/proximad"
    install -m 0755 "$build_dir/tools/proximactl/proximactl" "$prefix/bin/proximactl"
    install -m 0644 deploy/config/proxima.yaml "$prefix/etc/proxima/proxima.yaml"
    # The installed daemon must accept the config it ships with.
    "$prefix/bin/proximad" --config="$prefix/etc/proxima/proxima.yaml" --check_config >/dev/null
    echo "container-build: installed proximad, proximactl and etc/proxima/proxima.yaml under $prefix"
    ;;
  runtime-packages)
    [ $# -eq 2 ] || usage
    prefix=$2
    # ldd resolves the full closure; dpkg -S names the package that owns each library.
    # Libraries of the C runtime itself (libc6, libgcc, libstdc++) are in every base image but
    # are listed anyway so that the list is complete.
    ldd "$prefix/bin/proximad" "$prefix/bin/proximactl" |
      awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
      while read -r lib; do
        real=$(readlink -f "$lib")
        dpkg -S "$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || {
          echo "container-build: no package owns $lib" >&2; exit 1; }
      done | cut -d: -f1 | sort -u
    ;;
  *) usage ;;
esac

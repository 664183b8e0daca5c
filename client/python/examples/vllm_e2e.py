"""End to end with a real vLLM engine (needs a GPU, vLLM 0.33.0 and a local model directory):
the same prompts run twice, each time in a fresh engine process, against one proximad. The
second run must load its prefix KV from proximad (the daemon's Get hits grow) and produce the
same greedy output. Run by `scripts/gpu-check.sh vllm-e2e MODEL_DIR`.

    python vllm_e2e.py --target unix:/tmp/proximad.sock --model /models/Qwen2.5-0.5B-Instruct
"""
import argparse
import json
import multiprocessing as mp
import os
import sys

PROMPTS = ["You are a careful assistant. " * 40 + "Summarize the rules of chess.",
           "You are a careful assistant. " * 40 + "Explain how a KV cache speeds up decoding."]


def generate(model: str, target: str, queue) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, enable_prefix_caching=True, gpu_memory_utilization=0.5,
              kv_transfer_config={"kv_connector": "ProximaConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "proxima.vllm",
                                  "kv_connector_extra_config": {"target": target}})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32))
    queue.put([o.outputs[0].text for o in outs])


def run_once(model: str, target: str):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=generate, args=(model, target, q))
    p.start()
    texts = q.get(timeout=1800)
    p.join()
    return texts


def get_hits(target: str) -> int:
    import proxima
    stats = proxima.Client(target).stats()
    return sum(int(n.get("get_hits", 0)) for n in stats["namespaces"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--target", required=True)
    a = ap.parse_args()
    first = run_once(a.model, a.target)
    hits_before = get_hits(a.target)
    second = run_once(a.model, a.target)
    hits = get_hits(a.target) - hits_before
    result = {"same_output": first == second, "blocks_loaded_second_run": hits,
              "first": first, "second": second}
    print(json.dumps(result, indent=1))
    return 0 if first == second and hits > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

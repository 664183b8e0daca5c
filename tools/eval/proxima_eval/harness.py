"""The evaluation: what storing a prefix's KV through a codec plan costs on the next text.

For each sample (a window of prefix_len + suffix_len tokens):
  1. exact: prefill the prefix -> KV cache (bf16, as stored raw); prefill the suffix on top of it
     -> logits of the suffix positions;
  2. per plan: split the prefix KV into blocks of tokens_per_block, round-trip each block through
     the codec (encode + decode, as the daemon stores and returns it), prefill the same suffix on
     top of the decoded cache -> logits;
  3. compare on the suffix: perplexity (exact vs compressed, over suffix tokens 1..S-1 predicted
     from positions 0..S-2), mean KL(P_exact || P_compressed) and top-1 agreement at the same
     positions.
Prefix tokens not filling a whole block stay raw (engines keep a partial last block on the GPU).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from . import corpus, metrics
from .bf16 import bf16_bits_to_fp32, fp32_to_bf16_bits
from .codecs import DEFAULT_PLANS, CodecPlan, load_backend
from .llama import KVCache


def roundtrip_prefix(kv_fp32: np.ndarray, plan: CodecPlan, backend, tokens_per_block: int):
    """kv_fp32 [L, 2, P, H, D] (bf16-valued). Returns (decoded fp32 KV, raw bytes, encoded
    bytes, list of per-block reconstruction-error dicts from the backend or [])."""
    bits = fp32_to_bf16_bits(kv_fp32)
    out = bits.copy()
    L, _, P, _, _ = bits.shape
    raw_bytes = enc_bytes = 0
    errs = []
    for b, s in enumerate(range(0, P - tokens_per_block + 1, tokens_per_block)):
        blk = np.ascontiguousarray(bits[:, :, s:s + tokens_per_block])
        dec, n = backend.roundtrip(blk, plan.layer_codecs(L, b))
        if dec.shape != blk.shape or dec.dtype != np.uint16:
            raise ValueError(f"codec returned {dec.shape} {dec.dtype}, expected {blk.shape}")
        out[:, :, s:s + tokens_per_block] = dec
        raw_bytes += blk.nbytes
        enc_bytes += n
        e = backend.reconstruction_error(blk, dec)
        if e is not None:
            errs.append(e)
    return bf16_bits_to_fp32(out), raw_bytes, enc_bytes, errs


@dataclasses.dataclass
class Sample:
    source: str  # "prose" | "generated"
    name: str
    tokens: List[int]


@dataclasses.dataclass
class Acc:
    nll_exact: float = 0.0
    nll_codec: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    n: int = 0
    samples: int = 0
    raw_bytes: int = 0
    enc_bytes: int = 0
    errs: list = dataclasses.field(default_factory=list)


def evaluate_sample(model, sample_tokens, prefix_len, plans, backend, tokens_per_block,
                    accs: Dict[str, Acc]):
    toks = list(sample_tokens)
    prefix, suffix = toks[:prefix_len], toks[prefix_len:]
    _, cache = model.forward(prefix, want_logits=False)
    exact_logits, _ = model.forward(suffix, cache)
    targets = np.asarray(suffix[1:])
    ref = exact_logits[:-1]
    nll_ex = metrics.nll(ref, targets)
    kv = cache.to_array()
    for plan in plans:
        dec, raw_b, enc_b, errs = roundtrip_prefix(kv, plan, backend, tokens_per_block)
        logits, _ = model.forward(suffix, KVCache.from_array(dec))
        test = logits[:-1]
        a = accs.setdefault(plan.spec, Acc())
        a.nll_exact += float(nll_ex.sum())
        a.nll_codec += float(metrics.nll(test, targets).sum())
        a.kl += float(metrics.kl_divergence(ref, test).sum())
        a.top1 += float(np.sum(np.argmax(ref, -1) == np.argmax(test, -1)))
        a.n += len(targets)
        a.samples += 1
        a.raw_bytes += raw_b
        a.enc_bytes += enc_b
        a.errs.extend(errs)


def summarize(plan: str, prefix_len: int, suffix_len: int, source: str, a: Acc,
              backend_name: str, tokens_per_block: int) -> dict:
    ppl_ex = float(np.exp(a.nll_exact / a.n))
    ppl_c = float(np.exp(a.nll_codec / a.n))
    row = dict(plan=plan, backend=backend_name, prefix_tokens=prefix_len,
               suffix_tokens=suffix_len, source=source, samples=a.samples, scored_tokens=a.n,
               tokens_per_block=tokens_per_block,
               compression_ratio=(a.raw_bytes / a.enc_bytes) if a.enc_bytes else None,
               ppl_exact=ppl_ex, ppl_codec=ppl_c,
               ppl_rel_change=metrics.relative_change(ppl_ex, ppl_c),
               kl_mean=a.kl / a.n, top1_agreement=a.top1 / a.n)
    if a.errs:
        keys = sorted(set().union(*a.errs))
        row["recon_error_mean"] = {k: float(np.mean([e[k] for e in a.errs if k in e]))
                                   for k in keys}
    else:
        row["recon_error_mean"] = None  # the backend exports no reconstruction-error measure
    return row


def generated_samples(model, tok, length: int, count: int) -> List[Sample]:
    """The model's own greedy continuations of chat prompts. When the assistant ends its turn,
    the user answers "Continue." and generation goes on: a multi-turn session, Proxima's case."""
    out = []
    im_end = tok.encode("<|im_end|>")
    cont = tok.encode("\n<|im_start|>user\nContinue.<|im_end|>\n<|im_start|>assistant\n")
    for i, p in enumerate(corpus.PROMPTS[:count]):
        toks = tok.encode(p)
        logits, cache = model.forward(toks, logits_from=len(toks) - 1)
        while len(toks) < length:
            t = int(np.argmax(logits[-1]))
            new = [t]
            if t in im_end or t == tok.eos_id:
                new = im_end + cont
            toks.extend(new)
            logits, cache = model.forward(new, cache, logits_from=len(new) - 1)
        out.append(Sample("generated", f"prompt{i}", toks[:length]))
    return out


def prose_samples(tok, length: int, max_windows: int) -> List[Sample]:
    out = []
    for name, text in corpus.prose_texts().items():
        for j, w in enumerate(corpus.windows(tok.encode(text), length, max_windows)):
            out.append(Sample("prose", f"{name}#{j}", w))
    return out[:max_windows]


def format_table(rows: List[dict]) -> str:
    head = ("| plan | prefix | source | samples/tokens | ratio | ppl exact | ppl codec | rel. change "
            "| KL (nats) | top-1 |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        ratio = "n/a" if r["compression_ratio"] is None else f"{r['compression_ratio']:.2f}x"
        lines.append(
            f"| `{r['plan']}` | {r['prefix_tokens']} | {r['source']} | "
            f"{r['samples']}/{r['scored_tokens']} | {ratio} | {r['ppl_exact']:.4f} | "
            f"{r['ppl_codec']:.4f} | {100 * r['ppl_rel_change']:+.3f}% | {r['kl_mean']:.2e} | "
            f"{100 * r['top1_agreement']:.2f}% |")
    return head + "\n".join(lines) + "\n"


def main(model, tok, args) -> int:
    try:
        backend = load_backend(args.backend)
    except ImportError as e:
        print(json.dumps(dict(error=f"codec backend {args.backend!r} not available: {e}")))
        return 3
    specs = args.plans or DEFAULT_PLANS
    plans = [CodecPlan.parse(s) for s in specs]
    have = set(backend.available_codecs())
    missing = sorted({c for p in plans for c in p.codecs_used()} - have)
    if missing:
        print(json.dumps(dict(error=f"backend {backend.name} lacks codecs {missing}",
                              available=sorted(have))))
        return 3
    rows = []
    for P in args.prefix:
        length = P + args.suffix
        groups = {"prose": prose_samples(tok, length, args.windows)}
        if args.generated and P <= 512:
            groups["generated"] = generated_samples(model, tok, length, args.generated)
        for source, samples in groups.items():
            accs: Dict[str, Acc] = {}
            t0 = time.time()
            for s in samples:
                evaluate_sample(model, s.tokens, P, plans, backend, args.tokens_per_block, accs)
            for plan in plans:
                row = summarize(plan.spec, P, args.suffix, source, accs[plan.spec],
                                backend.name, args.tokens_per_block)
                row["seconds"] = round(time.time() - t0, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.table:
        with open(args.table, "w") as f:
            f.write(format_table(rows))
    return 0

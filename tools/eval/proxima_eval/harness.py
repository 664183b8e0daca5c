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
from .codecs import DEFAULT_PLANS, CodecPlan, RegroupedBackend, load_backend
from .llama import KVCache


def roundtrip_prefix(kv_fp32: np.ndarray, plan: CodecPlan, backend, tokens_per_block: int):
    """kv_fp32 [L, 2, P, H, D] (bf16-valued). Returns (decoded fp32 KV, raw bytes, encoded
    bytes, list of per-block error-sum dicts from the backend, or [] when it has none)."""
    bits = fp32_to_bf16_bits(kv_fp32)
    out = bits.copy()
    L, _, P, _, _ = bits.shape
    raw_bytes = enc_bytes = 0
    errs = []
    for b, s in enumerate(range(0, P - tokens_per_block + 1, tokens_per_block)):
        blk = np.ascontiguousarray(bits[:, :, s:s + tokens_per_block])
        dec, n = backend.roundtrip(blk, plan, b == 0)
        if dec.shape != blk.shape or dec.dtype != np.uint16:
            raise ValueError(f"codec returned {dec.shape} {dec.dtype}, expected {blk.shape}")
        out[:, :, s:s + tokens_per_block] = dec
        raw_bytes += blk.nbytes
        enc_bytes += n
        e = backend.error_sums(blk, dec)
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
    # Per sample, for the bootstrap interval: summed NLL without and with the codec, tokens.
    sample_nll_exact: list = dataclasses.field(default_factory=list)
    sample_nll_codec: list = dataclasses.field(default_factory=list)
    sample_n: list = dataclasses.field(default_factory=list)


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
        nll_c = float(metrics.nll(test, targets).sum())
        a.nll_exact += float(nll_ex.sum())
        a.nll_codec += nll_c
        a.sample_nll_exact.append(float(nll_ex.sum()))
        a.sample_nll_codec.append(nll_c)
        a.sample_n.append(len(targets))
        a.kl += float(metrics.kl_divergence(ref, test).sum())
        a.top1 += float(np.sum(np.argmax(ref, -1) == np.argmax(test, -1)))
        a.n += len(targets)
        a.samples += 1
        a.raw_bytes += raw_b
        a.enc_bytes += enc_b
        a.errs.extend(errs)


def finish_error_sums(sums: List[Dict[str, float]]) -> dict:
    """kernels/error_metrics.h's figures over all blocks of all samples: sum the squared-error
    and reference sums first, then take sqrt(err / ref) (what ErrorSums::Add + Finish do)."""
    if not sums:
        return dict(k_rel_l2=None, v_rel_l2=None, attn_rel_l2=None)
    out = {}
    for name in ("k", "v", "attn"):
        err = sum(s[f"{name}_err"] for s in sums)
        ref = sum(s[f"{name}_ref"] for s in sums)
        out[f"{name}_rel_l2"] = (0.0 if err == 0 else float("inf")) if ref == 0 else \
            float(np.sqrt(err / ref))
    return out


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
               ppl_rel_change_ci95=metrics.ppl_change_interval(
                   a.sample_nll_exact, a.sample_nll_codec, a.sample_n),
               kl_mean=a.kl / a.n, top1_agreement=a.top1 / a.n)
    row.update(finish_error_sums(a.errs))
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


def model_fingerprint(path: str) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_generated(model, tok, length: int, count: int, path: str) -> None:
    samples = generated_samples(model, tok, length, count)
    with open(path, "w") as f:
        json.dump(dict(model_sha256=model_fingerprint(model.gm.path), length=length,
                       prompts=corpus.PROMPTS[:count],
                       samples=[dict(name=s.name, tokens=s.tokens) for s in samples]), f)
        f.write("\n")


def load_generated(model, tok, length: int, count: int, path: Optional[str]) -> List[Sample]:
    """Committed greedy continuations when they were made by this very model file and are long
    enough (greedy decoding in fp32 can take another path on another BLAS build, so we freeze
    the tokens for reproducible tables); otherwise generate them now."""
    if path:
        try:
            with open(path) as f:
                d = json.load(f)
            if (d["model_sha256"] == model_fingerprint(model.gm.path) and d["length"] >= length
                    and len(d["samples"]) >= count):
                return [Sample("generated", s["name"], s["tokens"][:length])
                        for s in d["samples"][:count]]
        except FileNotFoundError:
            pass
    return generated_samples(model, tok, length, count)


def prose_samples(tok, length: int, max_windows: int, corpus_name: str = "licenses"
                  ) -> List[Sample]:
    """Windows of `length` tokens. From the licences: text by text, in order (the figures in
    docs/quality.md were measured so). From the handbook: round-robin over its pages (each
    page's first window, then each page's second, ...), so that a sample of N windows spreads
    over as many pages, and so topics, as it can."""
    per_text = []
    for name, text in corpus.texts(corpus_name).items():
        ws = corpus.windows(tok.encode(text), length, max_windows)
        per_text.append([Sample("prose", f"{name}#{j}", w) for j, w in enumerate(ws)])
    if corpus_name == "licenses":
        out = [s for ws in per_text for s in ws]
    else:
        out = [ws[j] for j in range(max((len(ws) for ws in per_text), default=0))
               for ws in per_text if j < len(ws)]
    return out[:max_windows]


def _fig(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def format_table(rows: List[dict]) -> str:
    head = ("| plan | prefix | source | samples/tokens | ratio | ppl exact | ppl codec | rel. change "
            "| 95% interval | KL (nats) | top-1 | K rel L2 | V rel L2 | attn rel L2 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        ratio = "n/a" if r["compression_ratio"] is None else f"{r['compression_ratio']:.2f}x"
        ci = r.get("ppl_rel_change_ci95")
        interval = "n/a" if ci is None else f"{100 * ci[0]:+.2f}% .. {100 * ci[1]:+.2f}%"
        lines.append(
            f"| `{r['plan']}` | {r['prefix_tokens']} | {r['source']} | "
            f"{r['samples']}/{r['scored_tokens']} | {ratio} | {r['ppl_exact']:.4f} | "
            f"{r['ppl_codec']:.4f} | {100 * r['ppl_rel_change']:+.3f}% | {interval} | "
            f"{r['kl_mean']:.2e} | "
            f"{100 * r['top1_agreement']:.2f}% | {_fig(r['k_rel_l2'])} | {_fig(r['v_rel_l2'])} | "
            f"{_fig(r['attn_rel_l2'])} |")
    return head + "\n".join(lines) + "\n"


BEGIN_TABLE = "<!-- BEGIN TABLE -->"
END_TABLE = "<!-- END TABLE -->"


def replace_table(doc_path: str, text: str) -> None:
    """Replaces what lies between the TABLE markers of a markdown file."""
    with open(doc_path) as f:
        doc = f.read()
    i = doc.index(BEGIN_TABLE) + len(BEGIN_TABLE)
    j = doc.index(END_TABLE)
    with open(doc_path, "w") as f:
        f.write(doc[:i] + "\n" + text + doc[j:])


def main(model, tok, args) -> int:
    try:
        backend = load_backend(args.backend)
    except ImportError as e:
        print(json.dumps(dict(error=f"codec backend {args.backend!r} not available: {e}")))
        return 3
    if getattr(args, "codec_head_dim", 0):
        backend = RegroupedBackend(backend, args.codec_head_dim)
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
        # Rows say which prose they measured: "prose" (the licences, as always) or "handbook".
        prose = "prose" if args.corpus == "licenses" else args.corpus
        groups = {prose: prose_samples(tok, length, args.windows, args.corpus)}
        if args.generated and P <= 512:
            groups["generated"] = load_generated(model, tok, length, args.generated,
                                                 args.continuations)
        for source, samples in groups.items():
            if not samples:  # --windows 0: generated text only
                continue
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

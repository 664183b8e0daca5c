"""Would a 3-bit level reach 4x within the 1% perplexity budget? (issue 4; docs/quality.md,
"Below 4 bits"). A numpy model of candidate codecs, run on the real model the way
`proxima_eval eval` runs the C++ codec: prefill a prose prefix, quantize its KV in 64-token
blocks, score the suffix on the decoded cache against the exact one.

Not a codec of the product: it exists to decide whether one is worth writing. Its int4 variant
(K per channel along tokens, V per token along channels, bf16 scale and minimum per group) gives
the same perplexity change as the C++ `int4` on the same windows (+0.708% at prefix 512), which
is the check that the model is faithful.

  PYTHONPATH=tools/eval python3 tools/eval/explore/lowbit_eval.py K4V4,K3V3H,K3V3H+sink8 \
      --prefix 512 --windows 4

Variant names: K<bits>[mode] V<bits>[mode] with modes
  (none)  K: groups of one channel along the block's tokens; V: one token along its channels
  H       rotate each (token, head) vector by a fixed randomized Hadamard matrix first (QuaRot's
          idea; orthogonal, undone after decoding); for K the groups are then along channels
  O       "dense and sparse": per group the value farthest from the median is kept exactly
          (bf16 + a 1-byte index, 24 bits) and left out of the group's range
  P       K only: quantize K before RoPE (KVQuant's idea): undo the rotation at each token's
          position, quantize per channel along tokens, rotate back; the positions are the
          block's (the daemon knows them from the client's block position)
  R       K only: as P, but the block's first token counts as position 0 (a codec that needs no
          positions: a constant rotation per channel pair is all that differs from P)
  S       symmetric: the group's range is [-max|x|, max|x|], only the scale is stored (16 bits
          per group instead of 32)
  C       clip: per group, the range [min, max] is shrunk to the one of 12 candidates (both ends
          pulled in by 0-33%) whose decoded group has the least squared error
and suffixes +sink4 / +sink8 (the sequence's first block at int4 / int8) and +first2 (layers 0-1
at int8). The ratio counts codes and per-group metadata (and outliers), not the container.
"""
import argparse
import json
import os
import sys

import numpy as np

from proxima_eval import harness, metrics, runtime
from proxima_eval.bf16 import round_to_bf16
from proxima_eval.llama import KVCache


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotation(dim: int) -> np.ndarray:
    signs = np.random.default_rng(7).choice([-1.0, 1.0], size=dim)
    return signs[:, None] * hadamard(dim)


def quantize(a: np.ndarray, axis: int, bits: int, outliers: bool, clip: bool = False,
             symmetric: bool = False):
    """Asymmetric uniform quantization of groups along `axis`; returns (decoded, bits used)."""
    a2 = np.moveaxis(a, axis, -1)
    mask = np.zeros(a2.shape, bool)
    if outliers:
        mid = np.median(a2, axis=-1, keepdims=True)
        far = np.argmax(np.abs(a2 - mid), axis=-1)[..., None]
        np.put_along_axis(mask, far, True, axis=-1)
        inliers = np.where(mask, mid, a2)
    else:
        inliers = a2
    levels = 2 ** bits - 1
    lo0, hi0 = inliers.min(axis=-1, keepdims=True), inliers.max(axis=-1, keepdims=True)
    if symmetric:
        hi0 = np.maximum(np.abs(lo0), np.abs(hi0))
        lo0 = -hi0
    best, best_err = None, None
    for shrink in (np.linspace(0.0, 0.33, 12) if clip else (0.0,)):
        lo = lo0 + shrink * (hi0 - lo0) / 2
        hi = hi0 - shrink * (hi0 - lo0) / 2
        scale = round_to_bf16(np.maximum((hi - lo) / levels, 1e-30))
        mn = -scale * levels / 2 if symmetric else round_to_bf16(lo)
        code = np.clip(np.rint((inliers - mn) / scale), 0, levels)
        dec = mn + code * scale
        err = np.sum((dec - inliers) ** 2, axis=-1, keepdims=True)
        if best is None:
            best, best_err = dec, err
        else:
            better = err < best_err
            best, best_err = np.where(better, dec, best), np.where(better, err, best_err)
    out = np.where(mask, a2, best)
    meta = 16 if symmetric else 32
    used = a2.size * bits + (a2.size // a2.shape[-1]) * meta + int(mask.sum()) * 24
    return np.moveaxis(out, -1, axis), used


def parse(part: str):
    """'K3PC' -> (3, rotate, outliers, pre_rope, clip, symmetric); pre_rope is "P", "R" or ""."""
    body = part[1:]
    digits = "".join(c for c in body if c.isdigit())
    pre_rope = "P" if "P" in body else ("R" if "R" in body else "")
    return int(digits), "H" in body, "O" in body, pre_rope, "C" in body, "S" in body


def encode_tensor(x: np.ndarray, is_key: bool, spec, rot: np.ndarray, model, pos):
    """x: one layer's K or V of one block, [tokens][heads][dim]; pos: the tokens' positions."""
    bits, rotate, outliers, pre_rope, clip, symmetric = spec
    if bits >= 16:
        return x, x.size * 16
    if pre_rope == "R":
        pos = pos - pos[0]
    y = model._rope(x, -pos) if pre_rope else x
    y = y @ rot if rotate else y
    # K without rotation: per channel along tokens (KIVI); everything else per token.
    axis = 0 if (is_key and not rotate) else -1
    d, used = quantize(y, axis, bits, outliers, clip, symmetric)
    if rotate:
        d = d @ rot.T
    if pre_rope:
        d = model._rope(d.astype(np.float32), pos)
    return round_to_bf16(d), used


def roundtrip(kv: np.ndarray, variant: str, tokens_per_block: int, rot: np.ndarray, model):
    base, *opts = variant.split("+")
    k_part, v_part = base[:base.index("V")], base[base.index("V"):]
    k_spec, v_spec = parse(k_part), parse(v_part)
    out = kv.copy()
    used = raw = 0
    L, _, P, _, _ = kv.shape
    for b, s in enumerate(range(0, P - tokens_per_block + 1, tokens_per_block)):
        for layer in range(L):
            ks, vs = k_spec, v_spec
            if "first2" in opts and layer < 2:
                ks = vs = (8, False, False, "", False, False)
            if b == 0 and "sink8" in opts:
                ks = vs = (8, False, False, "", False, False)
            if b == 0 and "sink4" in opts:
                ks = vs = (4, False, False, "", False, False)
            for kv_i, spec in ((0, ks), (1, vs)):
                x = kv[layer, kv_i, s:s + tokens_per_block]
                pos = np.arange(s, s + tokens_per_block)
                d, n = encode_tensor(x, kv_i == 0, spec, rot, model, pos)
                out[layer, kv_i, s:s + tokens_per_block] = d
                used += n
                raw += x.size * 16
    return out, raw / used


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help="comma-separated, e.g. K4V4,K3V3H+sink4")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--source", choices=("prose", "generated"), default="prose",
                    help="generated: the model's frozen greedy continuations (prefix <= 512)")
    args = ap.parse_args()
    model, tok = runtime.load(None)
    names = args.variants.split(",")
    acc = {n: dict(nll_exact=0.0, nll=0.0, kl=0.0, top1=0.0, n=0, ratio=0.0) for n in names}
    length = args.prefix + args.suffix
    if args.source == "generated":
        frozen = os.path.join(os.path.dirname(harness.__file__), "..", "testdata",
                              "continuations_smollm2.json")
        samples = harness.load_generated(model, tok, length, args.windows, frozen)
    else:
        samples = harness.prose_samples(tok, length, args.windows)
    for sample in samples:
        prefix, suffix = sample.tokens[:args.prefix], sample.tokens[args.prefix:]
        _, cache = model.forward(prefix, want_logits=False)
        exact, _ = model.forward(suffix, cache)
        targets, ref = np.asarray(suffix[1:]), exact[:-1]
        kv = cache.to_array()
        rot = rotation(kv.shape[-1])
        for n in names:
            dec, ratio = roundtrip(kv, n, args.tokens_per_block, rot, model)
            logits, _ = model.forward(suffix, KVCache.from_array(dec))
            test, a = logits[:-1], acc[n]
            a["nll_exact"] += float(metrics.nll(ref, targets).sum())
            a["nll"] += float(metrics.nll(test, targets).sum())
            a["kl"] += float(metrics.kl_divergence(ref, test).sum())
            a["top1"] += float(np.sum(np.argmax(ref, -1) == np.argmax(test, -1)))
            a["n"] += len(targets)
            a["ratio"] = ratio
    for n, a in acc.items():
        change = np.exp((a["nll"] - a["nll_exact"]) / a["n"]) - 1
        print(json.dumps(dict(variant=n, source=args.source, prefix=args.prefix, tokens=a["n"],
                              ratio=round(a["ratio"], 3), ppl_change_pct=round(100 * change, 3),
                              kl=round(a["kl"] / a["n"], 5), top1=round(a["top1"] / a["n"], 4))),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

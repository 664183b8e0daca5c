"""How much could an entropy coder behind int4 add to its ratio? (issue 4; docs/quality.md,
"Below 4 bits"). Quantizes the real KV dump as `int4` does (K: groups of one channel along the
block's tokens, V: one token along its channels; minimum and scale per group, 16 levels) and
prints the zeroth-order entropy of the 4-bit codes, in bits per code, for 16- and 64-token
blocks and groups of 32 and 64. An ideal coder of the codes alone (metadata untouched) would
store each code in that many bits instead of 4.

  PYTHONPATH=tools/eval python3 tools/eval/explore/int4_entropy.py
"""
import sys

import numpy as np

from proxima_eval import kvdump

DUMP = "tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv"


def entropy_bits(codes: np.ndarray) -> float:
    counts = np.bincount(codes.ravel(), minlength=16).astype(float)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def codes_along_last(a: np.ndarray, bits: int = 4) -> np.ndarray:
    lo = a.min(-1, keepdims=True)
    hi = a.max(-1, keepdims=True)
    levels = 2**bits - 1
    scale = np.maximum((hi - lo) / levels, 1e-30)
    return np.clip(np.rint((a - lo) / scale), 0, levels).astype(np.int64)


def main() -> int:
    kv = kvdump.read(sys.argv[1] if len(sys.argv) > 1 else DUMP).to_fp32()  # [L, 2, T, H, D]
    layers, _, tokens, heads, dim = kv.shape
    for tpb in (16, 64):
        for group in (32, 64):
            k_codes, v_codes = [], []
            for start in range(0, tokens - tpb + 1, tpb):
                k = kv[:, 0, start:start + tpb]  # [L, t, H, D]
                v = kv[:, 1, start:start + tpb]
                g = min(tpb, group)  # K groups run along the block's tokens
                k = k.reshape(layers, tpb // g, g, heads, dim)
                k_codes.append(codes_along_last(np.moveaxis(k, 2, -1)))
                v_codes.append(codes_along_last(v.reshape(layers, tpb, heads, dim // group, group)))
            k_bits = entropy_bits(np.concatenate([c.ravel() for c in k_codes]))
            v_bits = entropy_bits(np.concatenate([c.ravel() for c in v_codes]))
            print(f"tokens_per_block={tpb} group={group}: K codes {k_bits:.3f} bits, "
                  f"V codes {v_bits:.3f} bits (of 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

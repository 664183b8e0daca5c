#!/usr/bin/env python3
"""Writes the seed corpus of the codec_encode fuzz target (tests/fuzz/codec_encode_fuzz_body.h
describes the input): every codec on both dtypes at two shapes, with the value modes, plan
ranges, sink codecs and group sizes spread over them, and a few shapes at the edges (k4v3 on a
head dim that is not a power of two, a partial last group, the widest dims). Rerun when the input layout changes:
    python3 tests/fuzz/make_encode_seeds.py tests/fuzz/corpus/codec_encode
"""
import random
import sys
from pathlib import Path

DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65,
        80, 96, 100, 127, 128, 129, 255, 256, 264, 272]
NONE = 8  # "no codec" for the layer range and the sink


def header(dtype_fp16, first, importance, mode, codec, range_codec, sink, group_sel, rope_sel,
           dim, tokens, heads, layers):
    flags = int(dtype_fp16) | (int(first) << 1) | (int(importance) << 2) | (mode << 3)
    return bytes([flags, codec, range_codec, sink + 9 * group_sel,
                  rope_sel + 5 * DIMS.index(dim), tokens - 1, heads - 1, layers - 1])


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261205)
    seeds = []
    for codec in range(8):
        for fp16 in (0, 1):
            for shape, (dim, tokens) in enumerate(((64, 16), (16, 33))):
                k = 4 * codec + 2 * fp16 + shape
                seeds.append(header(fp16, k % 3 == 0, codec == 6, k % 4, codec,
                                    NONE if k % 2 else (codec + 3) % 8,
                                    NONE if k % 5 else 3, k % 3, k % 5, dim, tokens, 2, 2))
    extras = [
        header(0, 0, 0, 1, 7, NONE, NONE, 1, 1, 24, 16, 1, 1),     # k4v3 on dim 24 (V in chunks of 16 and 8)
        header(1, 0, 0, 1, 7, NONE, NONE, 1, 3, 128, 64, 1, 1),    # k4v3, RoPE base 1e5
        header(0, 1, 0, 2, 7, 3, 4, 0, 2, 256, 9, 1, 2),           # k4v3 at 256, sink int4
        header(0, 0, 0, 1, 4, NONE, NONE, 2, 0, 3, 130, 3, 1),     # int4 g128, odd dim
        header(1, 0, 0, 0, 5, NONE, NONE, 0, 0, 40, 100, 2, 1),    # int2 on any bit pattern
        header(0, 0, 0, 2, 2, NONE, NONE, 0, 0, 272, 8, 1, 1),     # fp8, specials, widest dim
        header(1, 0, 0, 3, 3, 1, NONE, 0, 0, 264, 20, 2, 2),       # int8 near 1, lossless range
        header(0, 0, 1, 2, 6, NONE, NONE, 0, 0, 32, 128, 2, 1),    # star, importance
    ]
    seeds += extras
    for i, h in enumerate(seeds):
        values = bytes(rng.randrange(256) for _ in range(64 + 16 * (i % 5)))
        (out / f"seed_{i:02d}").write_bytes(h + values)
    print(f"wrote {len(seeds)} seeds to {out}")


if __name__ == "__main__":
    main()

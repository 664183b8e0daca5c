"""What k4v3's K turn does when the model's RoPE is not the layout it assumes (stop 46).

k4v3 turns each block's keys back by rotate-half RoPE over every channel at the profile's base
(docs/format.md). This takes SmolLM2-135M's real keys (tools/eval/testdata, positions 0-255,
rotate-half RoPE with base 1e5), takes the RoPE off (exact: the positions are known), puts back
one of several layouts, and encodes each 64-token block with k4v3 given the base 1e5 and given
none; the figure is K's relative L2 error over all blocks and layers. V is untouched.

    cd tools/eval && PYTHONPATH=.:<dir of proxima_codec_py> python3 explore/rope_layout_k4v3.py

Synthetic in one respect: the other layouts are applied to SmolLM2's pre-RoPE channels, which
the model was not trained with; the codec only sees the resulting numbers.
"""
import numpy as np
import proxima_codec_py as codec

from proxima_eval import bf16, kvdump

THETA = 1e5


def rope(x, pos, pairs, theta, rotary_dim, sign):
    """Rotates channel pairs of x [T, H, D] by sign * pos * theta^(-2i/rotary_dim)."""
    y = x.copy()
    for i, (a, b) in enumerate(pairs):
        ang = sign * pos[:, None] * theta ** (-2.0 * i / rotary_dim)
        c, s = np.cos(ang), np.sin(ang)
        y[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
        y[:, :, b] = x[:, :, b] * c + x[:, :, a] * s
    return y


def main():
    d = kvdump.read("testdata/smollm2-135m_gpl3_t0-256_bf16.pkv")
    kv = d.to_fp32()  # [L, 2, T, H, D]
    L, _, T, H, D = kv.shape
    pos = np.arange(T, dtype=np.float64)
    half = [(j, j + D // 2) for j in range(D // 2)]
    layouts = {
        "rotate-half, every channel (the model's own)": (half, D),
        "interleaved (GPT-J style), every channel": ([(2 * i, 2 * i + 1) for i in range(D // 2)], D),
        "rotate-half over the first quarter (partial 0.25)": (
            [(j, j + D // 8) for j in range(D // 8)], D // 4),
        "rotate-half, linear scaling factor 4": (half, D),
    }
    for name, (pairs, rotary_dim) in layouts.items():
        out = kv.copy()
        for layer in range(L):
            pre = rope(kv[layer, 0].astype(np.float64), pos, half, THETA, D, -1.0)
            p = pos / 4.0 if "linear" in name else pos
            out[layer, 0] = rope(pre, p, pairs, THETA, rotary_dim, +1.0)
        bits = bf16.fp32_to_bf16_bits(out)
        row = [name]
        for plan in ("k4v3,rope_theta=100000", "k4v3", "int4"):
            err = ref = 0.0
            for t0 in range(0, T, 64):
                block = np.ascontiguousarray(bits[:, :, t0:t0 + 64])
                dec = codec.decode_block(codec.encode_block(block, plan, False), list(block.shape))
                m = codec.measure_block_error(block, dec)
                err += m["k_err"]
                ref += m["k_ref"]
            row.append(f"{plan}: K rel L2 {np.sqrt(err / ref):.4f}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()

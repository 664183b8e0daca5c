#!/usr/bin/env python3
"""Offline evaluation of cross-layer sharing (MiniCache-style `xlayer`) on a real KV dump.

For each pair of adjacent layers (l, l+1) in the deep half, every (k|v, token, head) vector pair
is replaced by one shared direction (the normalised SLERP midpoint, t = 0.5) and the two
per-layer norms; pairs whose angle is too large (cosine below --min_cos) are kept for both
layers (MiniCache's retention). The shared direction and retained vectors are then int4 group
quantised along channels (group 64) and compared with plain int4 quantised the same way (note:
the shipped int4 codec groups K along tokens, KIVI-style, which is more accurate for K). Prints relative L2 error of K and V over the deep half
and the storage ratio with metadata counted. Not a shipped codec: see docs/benchmarks.md.

  python3 kernels/testdata/xlayer_eval.py PATH.pkv [--min_cos 0.0]
"""
import argparse
import struct

import numpy as np


def read_pkv(path):
    with open(path, "rb") as f:
        head = f.read(40)
        magic, ver, L, H, D, T, dtype, nbytes = struct.unpack("<8s6IQ", head)
        assert magic == b"PXKVDUMP" and ver == 1 and dtype == 2, "bf16 dumps only"
        raw = np.frombuffer(f.read(nbytes), dtype=np.uint16)
    x = (raw.astype(np.uint32) << 16).view(np.float32)
    return x.reshape(L, 2, T, H, D).astype(np.float64)


def int4_groups(x, group):
    """Asymmetric int4 along the last axis in groups; returns reconstruction and bits used."""
    shp = x.shape
    g = x.reshape(-1, group)
    mn, mx = g.min(1, keepdims=True), g.max(1, keepdims=True)
    scale = (mx - mn) / 15.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint((g - mn) / scale), 0, 15)
    bits = g.size * 4 + g.shape[0] * 32  # 4-bit values + fp16 scale + fp16 min per group
    return (q * scale + mn).reshape(shp), bits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pkv")
    ap.add_argument("--min_cos", type=float, default=0.0)
    ap.add_argument("--group", type=int, default=64)
    a = ap.parse_args()
    kv = read_pkv(a.pkv)
    L = kv.shape[0]
    first = L // 2
    for name, which in (("K", 0), ("V", 1)):
        err = ref = err4 = 0.0
        bits_x = bits_4 = 0
        kept = total = 0
        for l in range(first, L - 1, 2):
            x0, x1 = kv[l, which], kv[l + 1, which]  # [T][H][D]
            n0 = np.linalg.norm(x0, axis=-1, keepdims=True)
            n1 = np.linalg.norm(x1, axis=-1, keepdims=True)
            u0, u1 = x0 / np.maximum(n0, 1e-30), x1 / np.maximum(n1, 1e-30)
            cos = np.clip((u0 * u1).sum(-1, keepdims=True), -1, 1)
            mid = u0 + u1
            mid /= np.maximum(np.linalg.norm(mid, axis=-1, keepdims=True), 1e-30)
            retain = cos < a.min_cos
            dq, b = int4_groups(mid, a.group)
            r0 = np.where(retain, int4_groups(x0, a.group)[0], n0 * dq)
            r1 = np.where(retain, int4_groups(x1, a.group)[0], n1 * dq)
            nvec = mid.shape[0] * mid.shape[1]
            nret = int(retain.sum())
            # shared direction + 2 fp16 norms per vector; retained vectors add a second int4 copy
            bits_x += b + nvec * 32 + nret * (mid.shape[-1] * 4 + 32 * mid.shape[-1] // a.group)
            kept += nret
            total += nvec
            err += ((r0 - x0) ** 2).sum() + ((r1 - x1) ** 2).sum()
            ref += (x0 ** 2).sum() + (x1 ** 2).sum()
            q0, b0 = int4_groups(x0, a.group)
            q1, b1 = int4_groups(x1, a.group)
            err4 += ((q0 - x0) ** 2).sum() + ((q1 - x1) ** 2).sum()
            bits_4 += b0 + b1
        raw_bits = 2 * total * kv.shape[-1] * 16
        print(f"{name}: xlayer+int4 rel_l2={np.sqrt(err / ref):.4f} ratio={raw_bits / bits_x:.2f}x "
              f"retained={kept}/{total} | int4 rel_l2={np.sqrt(err4 / ref):.4f} "
              f"ratio={raw_bits / bits_4:.2f}x (layers {first}..{L - 1}, pairs of adjacent layers)")


if __name__ == "__main__":
    main()

"""Throughput of the binding against a running proximad: put and get of N blocks, each sent as
one piece or as P pieces (the scatter/gather path, one staging copy per block), with the
Python-side cost included. Prints JSON lines.

    python bench_binding.py --target unix:/tmp/proximad.sock --blocks 512 --pieces 1 64
"""
import argparse
import json
import time

import numpy as np

import proxima


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    c = proxima.Client(a.target)
    # 4 layers x 8 KV heads x 128 dims x 16 tokens x bf16 x K,V: 256 KiB blocks.
    profile = c.register_profile(4, 8, 128, 16, "bf16", "bench_binding")
    size = profile.block_bytes
    src = np.random.default_rng(0).integers(0, 256, (a.blocks, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    for arr in (src, dst):
        c.register_buffer(arr.ctypes.data, arr.nbytes)
    for pieces in a.pieces:
        step = size // pieces
        def blocks(arr):
            base = arr.ctypes.data
            return [[(base + b * size + p * step, step) for p in range(pieces)]
                    for b in range(a.blocks)]
        best_put = best_get = float("inf")
        for r in range(a.repeat):
            keys = proxima.chain_keys(proxima.keys.scope_bytes("bench", pieces, r),
                                      range(a.blocks))
            t = time.perf_counter()
            c.put(profile, keys, blocks(src))
            best_put = min(best_put, time.perf_counter() - t)
            t = time.perf_counter()
            found = c.get(profile, keys, blocks(dst))
            best_get = min(best_get, time.perf_counter() - t)
            assert all(found) and np.array_equal(src, dst)
            c.delete(profile, keys)
        gb = a.blocks * size / 1e9
        print(json.dumps({"block_bytes": size, "blocks": a.blocks, "pieces": pieces,
                          "put_GBps": round(gb / best_put, 2), "get_GBps": round(gb / best_get, 2)}))


if __name__ == "__main__":
    main()

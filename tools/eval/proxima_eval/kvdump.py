"""The .pkv KV data file ("PXKVDUMP"), read by the codec benchmark and trace replay.

    offset 0: 8 bytes magic "PXKVDUMP"
    uint32 version (=1), uint32 num_layers, uint32 num_kv_heads, uint32 head_dim,
    uint32 num_tokens, uint32 dtype (1 = fp16, 2 = bf16), uint64 data_bytes  (little-endian)
    then data_bytes bytes: KV in layout [layer][k|v][token][head][dim], dtype elements
    (data_bytes == 2 * L * T * H * D * 2)

K is post-RoPE, as an inference engine caches it.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from .bf16 import bf16_bits_to_fp32, fp32_to_bf16_bits

MAGIC = b"PXKVDUMP"
VERSION = 1
DTYPE_FP16 = 1
DTYPE_BF16 = 2
_HEADER = struct.Struct("<8sIIIIIIQ")  # 40 bytes
HEADER_BYTES = _HEADER.size


@dataclasses.dataclass
class KVDump:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: int
    # [L, 2, T, H, D] uint16 bit patterns (bf16 or fp16 as `dtype` says).
    data: np.ndarray

    def to_fp32(self) -> np.ndarray:
        if self.dtype == DTYPE_BF16:
            return bf16_bits_to_fp32(self.data)
        return self.data.view(np.float16).astype(np.float32)


def encode(kv_fp32: np.ndarray, dtype: int = DTYPE_BF16) -> bytes:
    """kv_fp32: [L, 2, T, H, D]. Returns the whole file's bytes."""
    kv = np.asarray(kv_fp32, np.float32)
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected [L, 2, T, H, D], got {kv.shape}")
    if dtype == DTYPE_BF16:
        bits = fp32_to_bf16_bits(kv)
    elif dtype == DTYPE_FP16:
        bits = kv.astype(np.float16).view(np.uint16)
    else:
        raise ValueError(f"dtype {dtype}")
    payload = np.ascontiguousarray(bits).astype("<u2").tobytes()
    L, _, T, H, D = kv.shape
    header = _HEADER.pack(MAGIC, VERSION, L, H, D, T, dtype, len(payload))
    return header + payload


def write(path: str, kv_fp32: np.ndarray, dtype: int = DTYPE_BF16) -> int:
    blob = encode(kv_fp32, dtype)
    with open(path, "wb") as f:
        f.write(blob)
    return len(blob)


def decode(blob: bytes) -> KVDump:
    if len(blob) < HEADER_BYTES:
        raise ValueError("truncated header")
    magic, ver, L, H, D, T, dtype, nbytes = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC:
        raise ValueError("bad magic")
    if ver != VERSION:
        raise ValueError(f"unsupported version {ver}")
    if dtype not in (DTYPE_FP16, DTYPE_BF16):
        raise ValueError(f"unknown dtype {dtype}")
    if nbytes != 2 * L * T * H * D * 2:
        raise ValueError("data_bytes does not match the geometry")
    if len(blob) != HEADER_BYTES + nbytes:
        raise ValueError("file size does not match data_bytes")
    data = np.frombuffer(blob, "<u2", offset=HEADER_BYTES).astype(np.uint16)
    return KVDump(L, H, D, T, dtype, data.reshape(L, 2, T, H, D))


def read(path: str) -> KVDump:
    with open(path, "rb") as f:
        return decode(f.read())

"""Codec plans and the pluggable codec round trip.

A *plan* says which STAR-KV codec stores each (layer, block) of a prefix's KV, the way the
daemon's per-namespace configuration does: one default codec, overrides for layer ranges, and an
override for the first block of a sequence (attention sinks). Spec syntax:

    "int2"                                   every layer, every block at int2
    "int2;layers=0-1:int8;first_block=int8"  layers 0..1 and block 0 at int8, the rest int2

A *backend* performs the round trip of one block:

    roundtrip(block_bits, layer_codecs) -> (decoded_bits, encoded_bytes)

block_bits: uint16 bf16 bit patterns [layer][k|v][token][head][dim]; layer_codecs: one codec name
per layer; decoded_bits: same shape and dtype; encoded_bytes: the full encoded size, container
header and every codec's metadata included (what the daemon stores).

RawBackend is the identity ("raw" is a real STAR-KV codec: the uncompressed block). The real
codecs come only from the C++ kernels through the pybind11 module `proxima_codec_py`
(tools/eval/CMakeLists.txt); this package never imitates a codec in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class CodecPlan:
    spec: str
    default: str
    layer_overrides: Tuple[Tuple[int, int, str], ...] = ()
    first_block: Optional[str] = None

    @staticmethod
    def parse(spec: str) -> "CodecPlan":
        parts = [p.strip() for p in spec.split(";") if p.strip()]
        if not parts or "=" in parts[0]:
            raise ValueError(f"plan {spec!r}: must start with the default codec")
        default, overrides, first = parts[0], [], None
        for p in parts[1:]:
            key, _, val = p.partition("=")
            if key == "layers":
                rng, _, codec = val.partition(":")
                lo, _, hi = rng.partition("-")
                if not codec:
                    raise ValueError(f"plan {spec!r}: layers=LO-HI:CODEC expected")
                overrides.append((int(lo), int(hi or lo), codec))
            elif key == "first_block":
                first = val
            else:
                raise ValueError(f"plan {spec!r}: unknown key {key!r} (layers, first_block)")
        return CodecPlan(spec, default, tuple(overrides), first)

    def codec_for(self, layer: int, block_index: int) -> str:
        if block_index == 0 and self.first_block:
            return self.first_block
        for lo, hi, codec in self.layer_overrides:
            if lo <= layer <= hi:
                return codec
        return self.default

    def layer_codecs(self, num_layers: int, block_index: int) -> List[str]:
        return [self.codec_for(l, block_index) for l in range(num_layers)]

    def codecs_used(self) -> List[str]:
        s = {self.default, *(c for _, _, c in self.layer_overrides)}
        if self.first_block:
            s.add(self.first_block)
        return sorted(s)


# Plans measured by default: every codec alone, then mixed plans with the first layers and the
# first block (attention sinks) at higher fidelity.
DEFAULT_PLANS = [
    "raw", "lossless", "fp8", "int8", "int4", "int2", "star",
    "int4;layers=0-1:int8;first_block=int8",
    "int2;layers=0-1:int8;first_block=int8",
    "int2;layers=0-3:int4;first_block=int8",
    "star;layers=0-1:int8;first_block=int8",
]


class RawBackend:
    """The identity codec: decoded == input, encoded size == raw size (no container header).
    It is the exact reference of every comparison, and what tests use."""

    name = "raw-identity"

    def available_codecs(self) -> List[str]:
        return ["raw"]

    def roundtrip(self, block_bits: np.ndarray, layer_codecs: Sequence[str]):
        if any(c != "raw" for c in layer_codecs):
            raise KeyError(f"RawBackend only has 'raw', asked {sorted(set(layer_codecs))}")
        return block_bits.copy(), int(block_bits.nbytes)

    def reconstruction_error(self, orig_bits, decoded_bits) -> Optional[Dict[str, float]]:
        return None


class KernelsBackend:
    """The real STAR-KV codec (C++ kernels/) through the pybind11 module proxima_codec_py."""

    name = "proxima-kernels"

    def __init__(self, module):
        self.m = module

    @staticmethod
    def load() -> "KernelsBackend":
        return KernelsBackend(importlib.import_module("proxima_codec_py"))

    def available_codecs(self) -> List[str]:
        return list(self.m.codec_names())

    def roundtrip(self, block_bits: np.ndarray, layer_codecs: Sequence[str]):
        L, _, T, H, D = block_bits.shape
        blob = self.m.encode_block(np.ascontiguousarray(block_bits, np.uint16), list(layer_codecs))
        out = np.asarray(self.m.decode_block(blob, L, T, H, D), np.uint16).reshape(block_bits.shape)
        return out, len(blob)

    def reconstruction_error(self, orig_bits, decoded_bits) -> Optional[Dict[str, float]]:
        f = getattr(self.m, "reconstruction_error", None)
        if f is None:
            return None
        return dict(f(np.ascontiguousarray(orig_bits, np.uint16),
                      np.ascontiguousarray(decoded_bits, np.uint16)))


def load_backend(name: str):
    if name == "raw":
        return RawBackend()
    if name == "kernels":
        return KernelsBackend.load()
    raise ValueError(f"unknown backend {name!r} (raw, kernels)")

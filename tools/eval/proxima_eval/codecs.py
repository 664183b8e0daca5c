"""Codec plans and the pluggable codec round trip.

A *plan* says which STAR-KV codec stores each (layer, block) of a prefix's KV, the way the
daemon's per-namespace configuration does, in the text form of kernels/codec.h:

    "int2"                                   every layer, every block at int2
    "layers[0:2]=int8,default=int2,sink=int8"  layers 0..1 at int8, the rest int2, and the first
                                             block of the sequence at least int8

A *backend* performs the round trip of one block:

    roundtrip(block_bits, plan, is_first_block) -> (decoded_bits, encoded_bytes)

block_bits: uint16 bf16 bit patterns [layer][k|v][token][head][dim]; decoded_bits: same shape and
dtype; encoded_bytes: the full encoded size, container header and every codec's metadata
included (what the daemon stores).

RawBackend is the identity ("raw" is a real STAR-KV codec: the uncompressed block). The real
codecs come only from the C++ kernels through the pybind11 module `proxima_codec_py`
(tools/eval/CMakeLists.txt); this package never imitates a codec in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Dict, List, Optional, Tuple

import numpy as np


# Fidelity order of kernels/codec.h (Fidelity()): higher is closer to the input.
FIDELITY = {"raw": 7, "lossless": 7, "int8": 6, "fp8": 5, "int4": 4, "k4v3": 3, "star": 2,
            "int2": 1}


@dataclasses.dataclass(frozen=True)
class CodecPlan:
    """A STAR-KV codec plan in the text form of kernels/codec.h ParseCodecPlan (docs/format.md
    section 4): comma-separated items; a bare codec name means default=; `layers[a:b]=CODEC`
    (half-open, first match wins); `sink=CODEC` (first block of a sequence: each layer uses the
    higher-fidelity of its planned codec and the sink codec); `group=32|64|128` (int4/int2/k4v3);
    `rope_theta=X` (the model's RoPE base, which k4v3 un-rotates K with).

    The C++ parser is authoritative (KernelsBackend hands it the text); this port lets the
    identity backend and the tests know which codec each layer gets.
    """

    spec: str
    default: str
    layer_ranges: Tuple[Tuple[int, int, str], ...] = ()
    sink: Optional[str] = None
    group: int = 64

    @staticmethod
    def parse(spec: str) -> "CodecPlan":
        if not spec.strip():
            raise ValueError("empty codec plan")
        default, ranges, sink, group = None, [], None, 64

        def codec(v: str) -> str:
            if v not in FIDELITY:
                raise ValueError(f"plan {spec!r}: unknown codec {v!r} ({', '.join(FIDELITY)})")
            return v

        for item in (x.strip() for x in spec.split(",")):
            key, eq, val = item.partition("=")
            key, val = key.strip(), val.strip()
            if not eq:
                key, val = "default", item
            if key == "default":
                if default is not None:
                    raise ValueError(f"plan {spec!r}: two defaults")
                default = codec(val)
            elif key == "sink":
                sink = codec(val)
            elif key == "group":
                if val not in ("32", "64", "128"):
                    raise ValueError(f"plan {spec!r}: group must be 32, 64 or 128")
                group = int(val)
            elif key == "rope_theta":
                try:
                    ok = 1.0 <= float(val) <= 1e12
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"plan {spec!r}: rope_theta must be a number from 1 to 1e12")
            elif key.startswith("layers[") and key.endswith("]"):
                lo, colon, hi = key[7:-1].partition(":")
                if not colon or not lo.strip().isdigit() or not hi.strip().isdigit() or \
                        int(lo) >= int(hi):
                    raise ValueError(f"plan {spec!r}: layers[a:b] with a < b expected")
                ranges.append((int(lo), int(hi), codec(val)))
            else:
                raise ValueError(f"plan {spec!r}: unknown item {item!r}")
        if default is None:
            default = "raw"
        return CodecPlan(spec, default, tuple(ranges), sink, group)

    def codec_for(self, layer: int, is_first_block: bool) -> str:
        c = self.default
        for lo, hi, codec in self.layer_ranges:
            if lo <= layer < hi:
                c = codec
                break
        if is_first_block and self.sink and FIDELITY[self.sink] > FIDELITY[c]:
            c = self.sink
        return c

    def layer_codecs(self, num_layers: int, is_first_block: bool) -> List[str]:
        return [self.codec_for(l, is_first_block) for l in range(num_layers)]

    def codecs_used(self) -> List[str]:
        s = {self.default, *(c for _, _, c in self.layer_ranges)}
        if self.sink:
            s.add(self.sink)
        return sorted(s)


# Plans measured by default: every codec alone, then mixed plans with the first layers and the
# first block (attention sinks) at higher fidelity.
DEFAULT_PLANS = [
    "raw", "lossless", "fp8", "int8", "int4", "int2", "star",
    "layers[0:2]=int8,default=int4,sink=int8",
    "layers[0:2]=int8,default=int2,sink=int8",
    "layers[0:4]=int4,default=int2,sink=int8",
    "layers[0:2]=int8,default=star,sink=int8",
]


class RawBackend:
    """The identity codec: decoded == input, encoded size == raw size (no container header).
    It is the exact reference of every comparison, and what tests use."""

    name = "raw-identity"

    def available_codecs(self) -> List[str]:
        return ["raw"]

    def roundtrip(self, block_bits: np.ndarray, plan: CodecPlan, is_first_block: bool):
        used = set(plan.layer_codecs(block_bits.shape[0], is_first_block))
        if used != {"raw"}:
            raise KeyError(f"RawBackend only has 'raw', plan uses {sorted(used)}")
        return block_bits.copy(), int(block_bits.nbytes)

    def error_sums(self, orig_bits, decoded_bits) -> Optional[Dict[str, float]]:
        return None  # the shared error measure lives in kernels/ (KernelsBackend)


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

    def roundtrip(self, block_bits: np.ndarray, plan: CodecPlan, is_first_block: bool):
        bits = np.ascontiguousarray(block_bits, np.uint16)
        blob = self.m.encode_block(bits, plan.spec, bool(is_first_block))
        out = np.asarray(self.m.decode_block(blob, bits.shape), np.uint16)
        return out.reshape(bits.shape), len(blob)

    def error_sums(self, orig_bits, decoded_bits) -> Optional[Dict[str, float]]:
        """kernels/error_metrics.h MeasureBlockError: squared-error and reference sums of K, V
        and attention output for probe queries (summed over blocks, then Finish())."""
        return dict(self.m.measure_block_error(np.ascontiguousarray(orig_bits, np.uint16),
                                               np.ascontiguousarray(decoded_bits, np.uint16)))


class RegroupedBackend:
    """Another backend that is handed each token's K (and V) channels of all KV heads read as
    vectors of `head_dim` channels: the model's [.., H, D] as [.., H*D/head_dim, head_dim], the
    same bytes in the same order. It measures a codec at a head dim the model does not have on
    the model's real values (e.g. SmolLM2's 3 heads of 64 as 2 heads of 96); the vectors then
    span the model's head boundaries, and K's RoPE pairs are not those of the new head dim (so a
    RoPE base in the plan would be wrong for them)."""

    def __init__(self, inner, head_dim: int):
        self.inner = inner
        self.head_dim = head_dim
        self.name = f"{inner.name}+heads-of-{head_dim}"

    def available_codecs(self) -> List[str]:
        return self.inner.available_codecs()

    def _view(self, bits: np.ndarray) -> np.ndarray:
        L, two, T, H, D = bits.shape
        if (H * D) % self.head_dim:
            raise ValueError(f"{H} heads of {D} channels cannot be read as heads of "
                             f"{self.head_dim}")
        return bits.reshape(L, two, T, H * D // self.head_dim, self.head_dim)

    def roundtrip(self, block_bits: np.ndarray, plan: CodecPlan, is_first_block: bool):
        dec, n = self.inner.roundtrip(self._view(block_bits), plan, is_first_block)
        return np.asarray(dec).reshape(block_bits.shape), n

    def error_sums(self, orig_bits, decoded_bits) -> Optional[Dict[str, float]]:
        return self.inner.error_sums(self._view(orig_bits), self._view(decoded_bits))


def load_backend(name: str):
    if name == "raw":
        return RawBackend()
    if name == "kernels":
        return KernelsBackend.load()
    raise ValueError(f"unknown backend {name!r} (raw, kernels)")

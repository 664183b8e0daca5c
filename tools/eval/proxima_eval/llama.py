"""Llama forward pass in numpy (fp32 math) with an explicit KV cache.

The cache is what Proxima stores: per layer, K (post-RoPE) and V of shape [T, H_kv, D]. With
kv_dtype="bf16" every K/V written to the cache is rounded to bf16 (round-to-nearest-even), as an
engine running a bf16 cache stores it; attention then reads the rounded values. The exact path of
the quality tool is this bf16 cache; the compressed path replaces the prefix part of it by what a
codec round trip returns.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np

from .bf16 import round_to_bf16
from .gguf_model import GGUFModel, ModelConfig


@dataclasses.dataclass
class KVCache:
    """K and V per layer, each [T, H_kv, D] fp32 (already bf16-valued when kv_dtype='bf16')."""

    k: List[np.ndarray]
    v: List[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return 0 if not self.k else int(self.k[0].shape[0])

    @staticmethod
    def empty(cfg: ModelConfig) -> "KVCache":
        z = np.zeros((0, cfg.num_kv_heads, cfg.head_dim), np.float32)
        return KVCache([z] * cfg.num_layers, [z] * cfg.num_layers)

    def to_array(self) -> np.ndarray:
        """[layer][k|v][token][head][dim] fp32, the canonical Proxima block layout."""
        return np.stack([np.stack([k, v]) for k, v in zip(self.k, self.v)])

    @staticmethod
    def from_array(a: np.ndarray) -> "KVCache":
        a = np.asarray(a, np.float32)
        return KVCache([a[l, 0] for l in range(a.shape[0])], [a[l, 1] for l in range(a.shape[0])])


def rope_inv_freq(cfg: ModelConfig, model: Optional[GGUFModel] = None) -> np.ndarray:
    d = cfg.rope_dim
    inv = 1.0 / (cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_scaling_factor
    elif cfg.rope_scaling == "llama3":
        # llama.cpp divides theta by the per-frequency factors stored in rope_freqs.weight.
        factors = np.asarray(model.weights["rope_freqs.weight"], np.float64).reshape(-1)
        inv = inv / factors
    return inv


class LlamaModel:
    def __init__(self, gm: GGUFModel, kv_dtype: str = "bf16"):
        if kv_dtype not in ("bf16", "fp32"):
            raise ValueError(kv_dtype)
        self.gm = gm
        self.cfg = gm.config
        self.kv_dtype = kv_dtype
        w = gm.weights
        self.inv_freq = rope_inv_freq(self.cfg, gm)
        self.embed = w["token_embd.weight"]
        self.out_norm = w["output_norm.weight"]
        self.out_w = w["output.weight"]
        self.layers = []
        for i in range(self.cfg.num_layers):
            p = f"blk.{i}."
            self.layers.append(dict(
                attn_norm=w[p + "attn_norm.weight"],
                # Q, K, V fused into one [in, out] matrix: one GEMM per layer.
                wqkv=np.ascontiguousarray(np.concatenate(
                    [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]]).T),
                wo=np.ascontiguousarray(w[p + "attn_output.weight"].T),
                ffn_norm=w[p + "ffn_norm.weight"],
                wgu=np.ascontiguousarray(np.concatenate(
                    [w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]).T),
                wd=np.ascontiguousarray(w[p + "ffn_down.weight"].T),
            ))

    def with_kv_dtype(self, kv_dtype: str) -> "LlamaModel":
        """The same model (weights shared, not copied) with another cache precision."""
        if kv_dtype not in ("bf16", "fp32"):
            raise ValueError(kv_dtype)
        import copy
        other = copy.copy(self)
        other.kv_dtype = kv_dtype
        return other

    # -- pieces -----------------------------------------------------------------------------
    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + np.float32(self.cfg.rms_eps))) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """HF rotate_half RoPE on x [T, H, D] at absolute positions pos [T]."""
        ang = pos.astype(np.float64)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _store(self, t: np.ndarray) -> np.ndarray:
        return round_to_bf16(t) if self.kv_dtype == "bf16" else t

    def _attention(self, q, k_all, v_all, pos, chunk=256):
        """q [Tq, H, D] at positions pos; k_all/v_all [Tk, Hkv, D] at positions 0..Tk-1."""
        cfg = self.cfg
        g = cfg.num_heads // cfg.num_kv_heads
        tq = q.shape[0]
        tk = k_all.shape[0]
        scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        kt = k_all.transpose(1, 2, 0)  # [Hkv, D, Tk]
        vt = v_all.transpose(1, 0, 2)  # [Hkv, Tk, D]
        out = np.empty((tq, cfg.num_heads, cfg.head_dim), np.float32)
        kpos = np.arange(tk)
        for s in range(0, tq, chunk):
            e = min(tq, s + chunk)
            qc = q[s:e].reshape(e - s, cfg.num_kv_heads, g, cfg.head_dim).transpose(1, 2, 0, 3)
            sc = np.matmul(qc, kt[:, None]) * scale  # [Hkv, G, tc, Tk]
            mask = kpos[None, :] > pos[s:e, None]  # [tc, Tk]
            sc = np.where(mask[None, None], np.float32(-np.inf), sc)
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(axis=-1, keepdims=True)
            o = np.matmul(sc, vt[:, None])  # [Hkv, G, tc, D]
            out[s:e] = o.transpose(2, 0, 1, 3).reshape(e - s, cfg.num_heads, cfg.head_dim)
        return out

    # -- public -----------------------------------------------------------------------------
    def forward(self, tokens, cache: Optional[KVCache] = None, logits_from: int = 0,
                want_logits: bool = True):
        """Runs `tokens` after the tokens already in `cache`.

        Returns (logits [len(tokens) - logits_from, vocab] fp32 or None, new cache holding the
        old entries followed by the new ones). The input cache is not modified.
        """
        cfg = self.cfg
        tokens = np.asarray(tokens, np.int64)
        if cache is None:
            cache = KVCache.empty(cfg)
        t0 = cache.num_tokens
        n = len(tokens)
        pos = np.arange(t0, t0 + n)
        x = self.embed[tokens].astype(np.float32)
        hq = cfg.num_heads * cfg.head_dim
        hk = cfg.num_kv_heads * cfg.head_dim
        new_k, new_v = [], []
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["attn_norm"])
            qkv = h @ L["wqkv"]
            q = qkv[:, :hq].reshape(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, hq:hq + hk].reshape(n, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, hq + hk:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
            q = self._rope(q, pos)
            k = self._store(self._rope(k, pos))
            v = self._store(np.ascontiguousarray(v))
            k_all = np.concatenate([cache.k[li], k]) if t0 else k
            v_all = np.concatenate([cache.v[li], v]) if t0 else v
            new_k.append(k_all)
            new_v.append(v_all)
            a = self._attention(q, k_all, v_all, pos)
            x = x + a.reshape(n, hq) @ L["wo"]
            h = self._rms(x, L["ffn_norm"])
            gu = h @ L["wgu"]
            gate, up = gu[:, :cfg.ffn], gu[:, cfg.ffn:]
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ L["wd"]
        logits = None
        if want_logits:
            xo = self._rms(x[logits_from:], self.out_norm)
            logits = xo @ self.out_w.T
        return logits, KVCache(new_k, new_v)

    def greedy(self, prompt_tokens, max_new: int, stop_ids=()) -> List[int]:
        logits, cache = self.forward(prompt_tokens, logits_from=len(prompt_tokens) - 1)
        out: List[int] = []
        for _ in range(max_new):
            t = int(np.argmax(logits[-1]))
            if t in stop_ids:
                break
            out.append(t)
            logits, cache = self.forward([t], cache)
        return out

"""Exports the real KV cache of a text prefix to a .pkv file."""

from __future__ import annotations

import numpy as np

from . import corpus, kvdump


def export_prefix(model, tokenizer, text_name: str, start: int, num_tokens: int, path: str,
                  dtype: int = kvdump.DTYPE_BF16) -> dict:
    """KV of tokens [start, start + num_tokens) of a corpus text, computed with the whole
    sequence [0, start + num_tokens) as context (so positions and RoPE are the real ones)."""
    text = corpus.prose_texts()[text_name]
    toks = tokenizer.encode(text)[: start + num_tokens]
    if len(toks) < start + num_tokens:
        raise ValueError(f"{text_name} has only {len(toks)} tokens")
    _, cache = model.forward(toks, want_logits=False)
    kv = cache.to_array()[:, :, start:start + num_tokens]  # [L, 2, T, H, D], bf16-valued
    size = kvdump.write(path, kv, dtype)
    return dict(path=path, text=text_name, start=start, num_tokens=num_tokens,
                num_layers=int(kv.shape[0]), num_kv_heads=int(kv.shape[3]),
                head_dim=int(kv.shape[4]), bytes=size,
                k_absmax=float(np.abs(kv[:, 0]).max()), v_absmax=float(np.abs(kv[:, 1]).max()))

"""llama.cpp (llama-cpp-python) as the independent reference for the forward pass."""

from __future__ import annotations

import numpy as np


def llamacpp_logits(path: str, tokens, top: int = 256, threads: int = 2):
    """Returns (top_ids [T, top], their logits [T, top]) from llama.cpp, ids sorted by logit
    descending, for every position of `tokens`."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(64, len(tokens) + 8), logits_all=True,
                          n_threads=threads, n_batch=512, verbose=False)
    llm.reset()
    llm.eval(list(tokens))
    lg = np.array(llm.scores[: len(tokens)], np.float32)
    ids = np.argsort(-lg, axis=1)[:, :top]
    return ids, np.take_along_axis(lg, ids, axis=1)

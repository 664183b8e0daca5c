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


# Prose and chat text, tokenized by llama.cpp itself so that the ids do not depend on our
# tokenizer; 24 positions.
REFERENCE_TEXT = ("The GNU General Public License is a free, copyleft license for software and "
                  "other kinds of works. <|im_start|>user\nHi!<|im_end|>")


def write_reference(model_path, out: str, top: int = 256) -> None:
    import llama_cpp
    from .gguf_model import default_model_path
    path = model_path or default_model_path()
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, vocab_only=True, verbose=False)
    tokens = llm.tokenize(REFERENCE_TEXT.encode(), add_bos=False, special=True)[:24]
    ids, lg = llamacpp_logits(path, tokens, top)
    np.savez_compressed(out, tokens=np.asarray(tokens, np.int64), top_ids=ids.astype(np.int32),
                        top_logits=lg.astype(np.float32),
                        llama_cpp_version=np.asarray(llama_cpp.__version__))

"""Loads the model once per process and keeps BLAS modest (the build machine is shared)."""

from __future__ import annotations

import functools
import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "2")

from .gguf_model import GGUFModel, default_model_path  # noqa: E402
from .llama import LlamaModel  # noqa: E402
from .tokenizer import GGUFTokenizer  # noqa: E402


@functools.lru_cache(maxsize=4)
def load(path: str | None = None, kv_dtype: str = "bf16"):
    gm = GGUFModel(path or default_model_path())
    return LlamaModel(gm, kv_dtype=kv_dtype), GGUFTokenizer(gm)

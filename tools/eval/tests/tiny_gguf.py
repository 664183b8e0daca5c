"""Writes small Llama-architecture GGUF files with random weights, for tests of what the loader
reads from a file (tokenizer kind, RoPE scaling) without a real model download."""

import numpy as np
import pytest

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2


def write_tiny_llama(path, pieces, scores, kinds, bos_id, eos_id, tokenizer="llama",
                     rope_scaling=None, rope_freqs=None, rope_base=10000.0):
    """`rope_scaling`: None or (type, factor) written as llama.rope.scaling.*; `rope_freqs`: None
    or a vector of HEAD_DIM / 2 per-frequency factors written as the tensor rope_freqs.weight
    (how Llama 3.1 files declare their scaling)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    if rope_scaling is not None:
        w.add_string("llama.rope.scaling.type", rope_scaling[0])
        w.add_float32("llama.rope.scaling.factor", float(rope_scaling[1]))
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(kinds)
    w.add_bos_token_id(bos_id)
    w.add_eos_token_id(eos_id)
    w.add_add_bos_token(True)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    t("token_embd.weight", len(pieces), HIDDEN)
    t("output_norm.weight", HIDDEN)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for b in range(LAYERS):
        t(f"blk.{b}.attn_norm.weight", HIDDEN)
        t(f"blk.{b}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{b}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{b}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        t(f"blk.{b}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        t(f"blk.{b}.ffn_norm.weight", HIDDEN)
        t(f"blk.{b}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{b}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{b}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def byte_vocab():
    """A vocabulary of <unk>, <s>, </s> and the 256 byte pieces: every text encodes."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [2, 3, 3] + [6] * 256
    return pieces, [0.0] * len(pieces), kinds

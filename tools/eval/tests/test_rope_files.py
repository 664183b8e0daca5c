"""RoPE scaling as a GGUF file declares it: none, linear (llama.rope.scaling.*) and Llama 3's
per-frequency factors (rope_freqs.weight), read from files written here; yarn is refused."""

import numpy as np
import pytest

import tiny_gguf
from proxima_eval.gguf_model import GGUFModel
from proxima_eval.llama import LlamaModel, rope_inv_freq


def _write(tmp_path, name, **kw):
    pieces, scores, kinds = tiny_gguf.byte_vocab()
    path = tmp_path / name
    tiny_gguf.write_tiny_llama(path, pieces, scores, kinds, 1, 2, **kw)
    return GGUFModel(str(path))


def _layer0_k(gm, n):
    """Layer 0's K for `n` copies of one token: it depends only on the token and the position
    (no attention before it), so runs of different RoPE settings can be compared position by
    position."""
    _, cache = LlamaModel(gm, kv_dtype="fp32").forward([7] * n)
    return cache.k[0]  # [T, H_kv, D]


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_linear_scaling_divides_every_frequency(tmp_path, factor):
    plain = _write(tmp_path, "plain.gguf")
    scaled = _write(tmp_path, "linear.gguf", rope_scaling=("linear", factor))
    assert plain.config.rope_scaling == "none"
    assert scaled.config.rope_scaling == "linear"
    assert scaled.config.rope_scaling_factor == factor
    np.testing.assert_allclose(rope_inv_freq(scaled.config, scaled),
                               rope_inv_freq(plain.config, plain) / factor, rtol=1e-12)
    # Linear scaling is position interpolation: position f*p of the scaled model is rotated as
    # position p of the unscaled one.
    f = int(factor)
    k_plain, k_scaled = _layer0_k(plain, 4), _layer0_k(scaled, 3 * f + 1)
    np.testing.assert_allclose(k_scaled[::f][:4], k_plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(k_scaled[1:4], k_plain[1:4])  # and it does change positions


def test_llama3_factors_from_rope_freqs_tensor(tmp_path):
    factors = np.linspace(1.0, 8.0, tiny_gguf.HEAD_DIM // 2)
    plain = _write(tmp_path, "plain.gguf")
    scaled = _write(tmp_path, "llama3.gguf", rope_freqs=factors)
    assert scaled.config.rope_scaling == "llama3"
    np.testing.assert_allclose(rope_inv_freq(scaled.config, scaled),
                               rope_inv_freq(plain.config, plain) / factors, rtol=1e-6)


def test_yarn_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        _write(tmp_path, "yarn.gguf", rope_scaling=("yarn", 4.0))

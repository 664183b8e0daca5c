"""The pybind11 binding of the real codec (skipped where proxima_codec_py is not built; build it
with CMake and put its folder on PYTHONPATH, as scripts/bench-quality.sh does)."""

import os

import numpy as np
import pytest

from proxima_eval import kvdump
from proxima_eval.codecs import DEFAULT_PLANS, CodecPlan, KernelsBackend, RegroupedBackend

pc = pytest.importorskip("proxima_codec_py")

HERE = os.path.dirname(os.path.abspath(__file__))
PKV = os.path.join(HERE, "..", "testdata", "smollm2-135m_gpl3_t0-256_bf16.pkv")


@pytest.fixture(scope="module")
def block():
    return np.ascontiguousarray(kvdump.read(PKV).data[:, :, :64])  # [30, 2, 64, 3, 64]


def test_python_plan_port_matches_cpp():
    for spec in DEFAULT_PLANS + ["layers[1:3]=fp8,layers[0:5]=int4,default=int2,sink=star"]:
        p = CodecPlan.parse(spec)
        for first in (False, True):
            assert p.layer_codecs(30, first) == list(pc.layer_codecs(spec, 30, first)), spec


def test_exact_codecs_round_trip_bit_exactly(block):
    be = KernelsBackend(pc)
    for spec in ("raw", "lossless"):
        dec, n = be.roundtrip(block, CodecPlan.parse(spec), True)
        np.testing.assert_array_equal(dec, block)
        s = be.error_sums(block, dec)
        assert s["k_err"] == 0 and s["v_err"] == 0 and s["attn_err"] == 0 and s["k_ref"] > 0
    assert n < block.nbytes  # lossless compresses real KV


def test_lossy_codecs_shrink_and_err_in_fidelity_order(block):
    be = KernelsBackend(pc)
    errs = {}
    for spec in ("int8", "int4", "int2"):
        dec, n = be.roundtrip(block, CodecPlan.parse(spec), False)
        assert n < block.nbytes
        s = be.error_sums(block, dec)
        errs[spec] = s["k_err"] / s["k_ref"] + s["v_err"] / s["v_ref"]
    assert 0 < errs["int8"] < errs["int4"] < errs["int2"]


def test_bad_input_raises_not_crashes(block):
    with pytest.raises(ValueError):
        pc.encode_block(block, "int9", False)
    blob = pc.encode_block(block, "int4", False)
    with pytest.raises((ValueError, RuntimeError)):
        pc.decode_block(blob[:-7], list(block.shape))


def test_regrouped_heads_reach_the_codec_as_the_other_head_dim(block):
    """--codec-head-dim 96: the codec encodes SmolLM2's 3 heads of 64 as 2 heads of 96 (its
    header says so), the decoded block comes back in the model's shape, and k4v3 at 96 (V's
    transform in chunks of 64 and 32) compresses beyond int4 there too."""
    be = RegroupedBackend(KernelsBackend(pc), 96)
    sizes = {}
    for spec in ("raw", "int4", "k4v3"):
        dec, sizes[spec] = be.roundtrip(block, CodecPlan.parse(spec), False)
        assert dec.shape == block.shape
        if spec == "raw":
            np.testing.assert_array_equal(dec, block)
    blob = bytes(pc.encode_block(be._view(block), "k4v3", False))
    assert int.from_bytes(blob[20:24], "little") == 96  # the header's head_dim
    assert sizes["k4v3"] < 0.9 * sizes["int4"] < sizes["raw"]
    with pytest.raises(ValueError, match="cannot be read as heads of 80"):
        RegroupedBackend(KernelsBackend(pc), 80).roundtrip(block, CodecPlan.parse("raw"), False)

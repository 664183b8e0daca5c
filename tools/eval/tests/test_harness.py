import numpy as np
import pytest

from proxima_eval import harness
from proxima_eval.bf16 import fp32_to_bf16_bits, bf16_bits_to_fp32
from proxima_eval.codecs import CodecPlan, RawBackend


def test_plan_parsing():
    p = CodecPlan.parse("int2;layers=0-1:int8;layers=5:int4;first_block=fp8")
    assert p.codec_for(0, 0) == "fp8"  # first block wins
    assert p.codec_for(1, 1) == "int8"
    assert p.codec_for(5, 3) == "int4"
    assert p.codec_for(6, 1) == "int2"
    assert p.codecs_used() == ["fp8", "int2", "int4", "int8"]
    assert CodecPlan.parse("star").layer_codecs(3, 0) == ["star"] * 3
    for bad in ["", "layers=0-1:int8", "int2;foo=1", "int2;layers=0-1"]:
        with pytest.raises(ValueError):
            CodecPlan.parse(bad)


class _NoiseForTests:
    """NOT a codec: adds relative noise to bf16 values so the harness has something to
    measure. Size reported as half the raw size, to check the ratio arithmetic."""

    name = "test-noise"

    def __init__(self, rel):
        self.rel = rel
        self.calls = []

    def roundtrip(self, bits, layer_codecs):
        self.calls.append((bits.shape, tuple(layer_codecs)))
        x = bf16_bits_to_fp32(bits)
        rng = np.random.default_rng(len(self.calls))
        return fp32_to_bf16_bits(x * (1 + self.rel * rng.standard_normal(x.shape))), bits.nbytes // 2

    def reconstruction_error(self, a, b):
        return None


def _sample(tok):
    from proxima_eval import corpus
    return tok.encode(corpus.prose_texts()["GPL-3"])[:96]


def test_raw_roundtrip_changes_nothing(smollm2):
    m, tok = smollm2
    accs = {}
    harness.evaluate_sample(m, _sample(tok), 64, [CodecPlan.parse("raw")], RawBackend(), 32,
                            accs)
    row = harness.summarize("raw", 64, 32, "prose", accs["raw"], "raw-identity", 32)
    assert row["ppl_codec"] == row["ppl_exact"] and row["kl_mean"] == 0.0
    assert row["top1_agreement"] == 1.0 and row["compression_ratio"] == 1.0
    assert row["scored_tokens"] == 31


def test_noise_costs_quality_monotonically(smollm2):
    m, tok = smollm2
    s = _sample(tok)
    plan = CodecPlan.parse("int2;layers=0-0:int8;first_block=fp8")
    rows = []
    for rel in (0.02, 0.3):
        be = _NoiseForTests(rel)
        accs = {}
        harness.evaluate_sample(m, s, 64, [plan], be, 32, accs)
        rows.append(harness.summarize(plan.spec, 64, 32, "prose", accs[plan.spec], be.name, 32))
        # Two full blocks of 32 tokens; block 0 all fp8, block 1 int8 on layer 0 then int2.
        assert [c[0] for c in be.calls] == [(30, 2, 32, 3, 64)] * 2
        assert set(be.calls[0][1]) == {"fp8"}
        assert be.calls[1][1][:2] == ("int8", "int2")
    small, big = rows
    assert small["compression_ratio"] == 2.0
    assert 0 < small["kl_mean"] < big["kl_mean"]
    assert big["top1_agreement"] < 1.0


def test_partial_last_block_stays_raw():
    kv = np.random.default_rng(0).normal(size=(2, 2, 70, 1, 4)).astype(np.float32)
    kv = bf16_bits_to_fp32(fp32_to_bf16_bits(kv))
    be = _NoiseForTests(0.5)
    dec, raw_b, enc_b, _ = harness.roundtrip_prefix(kv, CodecPlan.parse("int4"), be, 32)
    assert raw_b == 2 * 2 * 64 * 4 * 2 and enc_b == raw_b // 2
    np.testing.assert_array_equal(dec[:, :, 64:], kv[:, :, 64:])
    assert not np.array_equal(dec[:, :, :64], kv[:, :, :64])

import numpy as np
import pytest

from proxima_eval import harness
from proxima_eval.bf16 import fp32_to_bf16_bits, bf16_bits_to_fp32
from proxima_eval.codecs import CodecPlan, RawBackend


def test_plan_parsing_follows_kernels_codec_plan():
    p = CodecPlan.parse("layers[0:2]=int8,layers[1:6]=int4,default=int2,sink=fp8,group=32")
    assert p.codec_for(0, True) == "int8"  # sink is a floor: int8 beats fp8
    assert p.codec_for(1, False) == "int8"  # first matching range wins
    assert p.codec_for(5, False) == "int4"
    assert p.codec_for(5, True) == "fp8"
    assert p.codec_for(6, False) == "int2" and p.codec_for(6, True) == "fp8"
    assert p.group == 32
    assert p.codecs_used() == ["fp8", "int2", "int4", "int8"]
    assert CodecPlan.parse("star").layer_codecs(3, True) == ["star"] * 3
    k = CodecPlan.parse("layers[0:2]=int4,default=k4v3,rope_theta=100000,sink=int4")
    assert k.layer_codecs(3, False) == ["int4", "int4", "k4v3"]
    assert k.codec_for(2, True) == "int4"  # int4 is more faithful than k4v3
    for bad in ["", "layers[0:2]=int8,int4,default=int2", "int2,foo=1", "layers[2:2]=int8",
                "int3", "int2,group=16", "k4v3,rope_theta=0", "k4v3,rope_theta=abc"]:
        with pytest.raises(ValueError):
            CodecPlan.parse(bad)


class _NoiseForTests:
    """NOT a codec: adds relative noise to bf16 values so the harness has something to
    measure. Size reported as half the raw size, to check the ratio arithmetic."""

    name = "test-noise"

    def __init__(self, rel):
        self.rel = rel
        self.calls = []

    def roundtrip(self, bits, plan, is_first_block):
        self.calls.append((bits.shape, tuple(plan.layer_codecs(bits.shape[0], is_first_block))))
        x = bf16_bits_to_fp32(bits)
        rng = np.random.default_rng(len(self.calls))
        return fp32_to_bf16_bits(x * (1 + self.rel * rng.standard_normal(x.shape))), bits.nbytes // 2

    def error_sums(self, a, b):
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
    plan = CodecPlan.parse("layers[0:1]=int8,default=int2,sink=fp8")
    rows = []
    for rel in (0.02, 0.3):
        be = _NoiseForTests(rel)
        accs = {}
        harness.evaluate_sample(m, s, 64, [plan], be, 32, accs)
        rows.append(harness.summarize(plan.spec, 64, 32, "prose", accs[plan.spec], be.name, 32))
        # Two full blocks of 32 tokens; block 0: layer 0 int8, the rest raised to fp8 (sink);
        # block 1: layer 0 int8, the rest int2.
        assert [c[0] for c in be.calls] == [(30, 2, 32, 3, 64)] * 2
        assert be.calls[0][1][:2] == ("int8", "fp8") and set(be.calls[0][1][1:]) == {"fp8"}
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


def test_error_sums_are_pooled_before_the_ratio():
    # Two blocks: errors 1 and 0 over references 1 and 3 -> sqrt(1 / 4), not mean of ratios.
    s = [dict(k_err=1.0, k_ref=1.0, v_err=0.0, v_ref=2.0, attn_err=0.0, attn_ref=0.0),
         dict(k_err=0.0, k_ref=3.0, v_err=0.0, v_ref=2.0, attn_err=0.0, attn_ref=0.0)]
    f = harness.finish_error_sums(s)
    assert f["k_rel_l2"] == pytest.approx(0.5) and f["v_rel_l2"] == 0.0
    assert f["attn_rel_l2"] == 0.0
    assert harness.finish_error_sums([]) == dict(k_rel_l2=None, v_rel_l2=None, attn_rel_l2=None)


def test_table_row_format():
    row = dict(plan="int4", prefix_tokens=512, source="prose", samples=2, scored_tokens=510,
               compression_ratio=3.7, ppl_exact=10.0, ppl_codec=10.05, ppl_rel_change=0.005,
               kl_mean=1.5e-3, top1_agreement=0.991, k_rel_l2=0.1, v_rel_l2=None,
               attn_rel_l2=0.05)
    t = harness.format_table([row])
    assert "| `int4` | 512 | prose | 2/510 | 3.70x | 10.0000 | 10.0500 | +0.500% | n/a " \
           "| 1.50e-03 | 99.10% | 0.1000 | n/a | 0.0500 |" in t
    row["ppl_rel_change_ci95"] = (0.001, 0.0123)
    assert "| +0.500% | +0.10% .. +1.23% | 1.50e-03 |" in harness.format_table([row])


def test_handbook_paragraphs_skip_listings_and_navigation():
    from proxima_eval import corpus
    page = ('<html><body><ul class="docnav"><li>Prev</li></ul><div class="section">'
            '<div class="para">APT is a <code class="command">vast</code>\n\t project.</div>'
            '<div class="para">Run this:<div class="informalexample"><pre class="screen">'
            '$ apt update</pre></div> and wait &amp; see.</div>'
            '<div class="note"><p>not a paragraph</p></div><div class="para"> </div>'
            '</div></body></html>')
    assert corpus.html_paragraphs(page) == "APT is a vast project.\nRun this: and wait & see."


def test_unknown_corpus_is_refused_by_name():
    from proxima_eval import corpus
    with pytest.raises(ValueError, match="'novels'.*licenses, handbook"):
        corpus.texts("novels")


def test_handbook_windows_go_round_robin_over_pages(monkeypatch):
    from proxima_eval import corpus

    class _Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    monkeypatch.setattr(corpus, "handbook_texts",
                        lambda: {"a": "a" * 12, "b": "b" * 4, "c": "c" * 8})
    got = harness.prose_samples(_Chars(), 4, 5, "handbook")
    assert [s.name for s in got] == ["a#0", "b#0", "c#0", "a#1", "c#1"]
    assert all(len(s.tokens) == 4 and s.source == "prose" for s in got)
    monkeypatch.setattr(corpus, "prose_texts", lambda: {"x": "x" * 8, "y": "y" * 8})
    assert [s.name for s in harness.prose_samples(_Chars(), 4, 3)] == ["x#0", "x#1", "y#0"]

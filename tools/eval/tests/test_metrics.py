import math

import numpy as np
import pytest

from proxima_eval import metrics


def test_uniform_logits_perplexity_is_vocab_size():
    v = 1000
    logits = np.zeros((7, v))
    assert metrics.perplexity(logits, np.arange(7)) == pytest.approx(v, rel=1e-12)


def test_perplexity_of_known_probabilities():
    # Target probabilities 1/2 and 1/4 -> mean NLL = (ln 2 + ln 4) / 2 -> ppl = sqrt(8).
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))
    assert metrics.perplexity(logits, np.array([0, 0])) == pytest.approx(math.sqrt(8), rel=1e-12)


def test_logits_shift_invariance_and_large_values():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 50)) * 30
    t = rng.integers(0, 50, 5)
    assert metrics.perplexity(a + 1e4, t) == pytest.approx(metrics.perplexity(a, t), rel=1e-9)
    assert np.all(np.isfinite(metrics.nll(a * 100, t)))


def test_kl_known_value_and_zero_on_identity():
    p = np.array([0.5, 0.5])
    q = np.array([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl = metrics.kl_divergence(np.log(p)[None], np.log(q)[None])
    assert kl[0] == pytest.approx(expected, rel=1e-12)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 100))
    assert np.allclose(metrics.kl_divergence(x, x), 0.0, atol=1e-14)
    # Asymmetric, as KL is: the reverse direction is a different number.
    rev = metrics.kl_divergence(np.log(q)[None], np.log(p)[None])[0]
    assert rev != pytest.approx(expected)


def test_kl_nonnegative_random():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(2, 64, 300)) * 3
    assert np.all(metrics.kl_divergence(a, b) >= 0)


def test_top1_agreement():
    ref = np.array([[0, 1, 0], [2, 0, 0], [0, 0, 3], [1, 0, 0]], float)
    test = np.array([[0, 2, 0], [0, 5, 0], [0, 0, 1], [1, 0, 0]], float)
    assert metrics.top1_agreement(ref, test) == 0.75
    assert metrics.top1_agreement(ref, ref) == 1.0


def test_relative_change():
    assert metrics.relative_change(10.0, 10.5) == pytest.approx(0.05)


def test_ppl_change_interval():
    # Every window changes by exactly +1%: the interval is that point, whatever is resampled.
    counts = np.array([100, 200, 50, 80])
    e = np.array([250.0, 410.0, 140.0, 170.0])
    c = e + counts * np.log(1.01)
    lo, hi = metrics.ppl_change_interval(e, c, counts)
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.01)
    # Windows that disagree (one much worse, others unchanged) give an interval around the pooled
    # change that is wide and contains it; more windows of the same spread give a narrower one.
    rng = np.random.default_rng(1)
    counts = np.full(20, 255)
    e = rng.uniform(500, 700, 20)
    c = e + counts * rng.normal(0.01, 0.02, 20)
    pooled = np.exp((c.sum() - e.sum()) / counts.sum()) - 1
    lo, hi = metrics.ppl_change_interval(e, c, counts)
    assert lo < pooled < hi and hi - lo > 0.005
    counts80 = np.full(80, 255)
    e80 = rng.uniform(500, 700, 80)
    c80 = e80 + counts80 * rng.normal(0.01, 0.02, 80)
    lo80, hi80 = metrics.ppl_change_interval(e80, c80, counts80)
    assert hi80 - lo80 < hi - lo
    # Deterministic, and none with one window.
    assert metrics.ppl_change_interval(e, c, counts) == (lo, hi)
    assert metrics.ppl_change_interval([1.0], [1.1], [10]) is None

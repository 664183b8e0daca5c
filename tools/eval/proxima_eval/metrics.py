"""Quality metrics between the exact-KV run and a compressed-KV run on the same tokens.

All take logits [N, V] (one row per scored position) and compute in float64.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (nats) of targets [N] under logits [N, V], per position."""
    lp = log_softmax(logits)
    t = np.asarray(targets, np.int64)
    return -lp[np.arange(len(t)), t]


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    return float(np.exp(np.mean(nll(logits, targets))))


def kl_divergence(ref_logits: np.ndarray, test_logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_test) in nats per position: what the compressed cache loses against the
    exact one, weighted by where the exact model puts its probability."""
    lp = log_softmax(ref_logits)
    lq = log_softmax(test_logits)
    p = np.exp(lp)
    return np.maximum((p * (lp - lq)).sum(axis=-1), 0.0)


def top1_agreement(ref_logits: np.ndarray, test_logits: np.ndarray) -> float:
    return float(np.mean(np.argmax(ref_logits, -1) == np.argmax(test_logits, -1)))


def relative_change(exact: float, compressed: float) -> float:
    return (compressed - exact) / exact


def ppl_change_interval(nll_exact: np.ndarray, nll_codec: np.ndarray, counts: np.ndarray,
                        level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """Paired bootstrap interval of the relative perplexity change over samples (windows).

    nll_exact[i], nll_codec[i]: summed NLL of sample i's scored tokens without and with the codec;
    counts[i]: its scored tokens. Windows, not tokens, are resampled: tokens of one window are
    correlated, windows are drawn from different texts. Both runs are resampled together (the
    same windows), so what varies is the codec's effect, not the text's difficulty. Returns
    (low, high) of the `level` interval, or None with fewer than two samples. Deterministic for a
    given seed."""
    e = np.asarray(nll_exact, np.float64)
    c = np.asarray(nll_codec, np.float64)
    n = np.asarray(counts, np.float64)
    if len(e) < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(e), size=(resamples, len(e)))
    ne, nc, nn = e[idx].sum(axis=1), c[idx].sum(axis=1), n[idx].sum(axis=1)
    change = np.exp((nc - ne) / nn) - 1.0
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(change, alpha)), float(np.quantile(change, 1.0 - alpha))

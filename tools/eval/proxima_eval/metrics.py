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

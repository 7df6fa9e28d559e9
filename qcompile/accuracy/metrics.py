"""Accuracy metrics: float model vs an int8 model, and each against labels where data has them.

SQNR is capped at ``SQNR_CAP_DB`` (identical outputs would be +inf, which JSON cannot hold).
Cosine similarity is computed per sample (each output row flattened) and averaged; the minimum is
reported too, because one bad sample hides in a mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SQNR_CAP_DB = 200.0


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``reference`` in dB."""
    ref = np.asarray(reference, dtype=np.float64)
    noise = float(np.sum((ref - np.asarray(test, dtype=np.float64)) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0.0:
        return SQNR_CAP_DB
    if signal == 0.0:
        return -SQNR_CAP_DB
    return float(min(SQNR_CAP_DB, 10.0 * math.log10(signal / noise)))


def cosine_per_sample(reference: np.ndarray, test: np.ndarray) -> np.ndarray:
    a = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    b = np.asarray(test, dtype=np.float64).reshape(len(test), -1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.sum(a * b, axis=1)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0),
                    np.where(np.all(a == b, axis=1), 1.0, 0.0))


def topk_agreement(reference_logits: np.ndarray, test_logits: np.ndarray, k: int) -> float:
    """Fraction of samples whose reference top-1 class is among the test model's top-k."""
    ref_top1 = np.argmax(reference_logits, axis=1)
    test_topk = np.argsort(-test_logits, axis=1, kind="stable")[:, :k]
    return float(np.mean(np.any(test_topk == ref_top1[:, None], axis=1)))


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def is_pair_labels(labels: np.ndarray | None) -> bool:
    """Labels of a word/sentence-pair dataset: one ``(pair index, human score)`` row per sample."""
    return labels is not None and labels.ndim == 2 and labels.shape[1] == 2


def pair_spearman(embeddings: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    """Spearman rank correlation between the cosine of each pair's two embeddings and its human
    score, and the number of pairs used (pairs cut in half by a dropped sample are left out)."""
    from scipy.stats import spearmanr

    rows = np.argsort(labels[:, 0], kind="stable")
    ids = labels[rows, 0]
    same = np.flatnonzero(ids[:-1] == ids[1:])  # each pair index appears at most twice
    first, second = rows[same], rows[same + 1]
    if len(first) < 3:
        return float("nan"), int(len(first))
    cos = cosine_per_sample(embeddings[first], embeddings[second])
    return float(spearmanr(cos, labels[first, 1]).statistic), int(len(first))


@dataclass(frozen=True)
class Comparison:
    """``test`` (int8) measured against ``reference`` (float), plus task metrics per side."""

    compare: dict[str, float]
    float_metrics: dict[str, float] = field(default_factory=dict)
    int8_metrics: dict[str, float] = field(default_factory=dict)


def compare_outputs(reference: np.ndarray, test: np.ndarray, *, task: str,
                    labels: np.ndarray | None = None) -> Comparison:
    """All metrics of DESIGN.md's ``accuracy.compare`` for one output tensor per sample."""
    if reference.shape != test.shape:
        raise ValueError(f"output shapes differ: {reference.shape} vs {test.shape}")
    cos = cosine_per_sample(reference, test)
    compare = {
        "sqnr_db": sqnr_db(reference, test),
        "cosine": float(np.mean(cos)),
        "cosine_min": float(np.min(cos)),
        "max_abs": float(np.max(np.abs(reference.astype(np.float64) - test))),
        "samples": int(len(reference)),
    }
    float_m: dict[str, float] = {}
    int8_m: dict[str, float] = {}
    if task == "classification" and reference.ndim == 2:
        compare["top1_agreement"] = topk_agreement(reference, test, 1)
        compare["top5_agreement"] = topk_agreement(reference, test, min(5, reference.shape[1]))
        if labels is not None:
            float_m["accuracy"] = accuracy(reference, labels)
            int8_m["accuracy"] = accuracy(test, labels)
    if task == "embedding" and is_pair_labels(labels):
        float_m["spearman"], compare["pairs"] = pair_spearman(reference, labels)  # type: ignore[arg-type]
        int8_m["spearman"], _ = pair_spearman(test, labels)  # type: ignore[arg-type]
    return Comparison(compare, float_m, int8_m)

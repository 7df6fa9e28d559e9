"""Accuracy metrics and recipe thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.accuracy.metrics import (
    SQNR_CAP_DB,
    compare_outputs,
    pair_spearman,
    sqnr_db,
    topk_agreement,
)
from qcompile.accuracy.thresholds import check_thresholds
from qcompile.recipe import AccuracySection


def test_sqnr_known_value():
    ref = np.ones(100)
    assert sqnr_db(ref, ref + 0.1) == pytest.approx(20.0)
    assert sqnr_db(ref, ref) == SQNR_CAP_DB


def test_topk_agreement():
    ref = np.array([[3.0, 1, 0], [0, 3, 1]])
    test = np.array([[1.0, 3, 2], [0, 3, 1]])
    assert topk_agreement(ref, test, 1) == 0.5
    assert topk_agreement(ref, test, 3) == 1.0


def test_compare_classification_with_labels():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(50, 10))
    test = ref + rng.normal(scale=1e-3, size=ref.shape)
    labels = np.argmax(ref, axis=1)
    c = compare_outputs(ref, test, task="classification", labels=labels)
    assert c.float_metrics["accuracy"] == 1.0 and c.int8_metrics["accuracy"] > 0.9
    assert c.compare["top1_agreement"] > 0.9 and c.compare["cosine"] > 0.999
    assert c.compare["sqnr_db"] > 50


def test_compare_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shapes differ"):
        compare_outputs(np.zeros((2, 3)), np.zeros((2, 4)), task="regression")


def test_thresholds_pass_fail_and_unmeasured():
    ref = np.eye(4)
    c = compare_outputs(ref, ref * 0.9, task="embedding")
    checks = check_thresholds(AccuracySection(min_cosine=0.99, min_sqnr_db=30.0,
                                              min_top1_agreement=0.9), c)
    by_key = {ch.key: ch for ch in checks}
    assert by_key["min_cosine"].passed
    assert not by_key["min_sqnr_db"].passed and by_key["min_sqnr_db"].value == pytest.approx(20)
    assert not by_key["min_top1_agreement"].passed
    assert "not measured" in by_key["min_top1_agreement"].note


def test_task_metric_drop():
    ref = np.array([[1.0, 0], [0, 1], [1, 0], [0, 1]])
    test = np.array([[1.0, 0], [0, 1], [1, 0], [1, 0]])
    c = compare_outputs(ref, test, task="classification", labels=np.array([0, 1, 0, 1]))
    checks = check_thresholds(AccuracySection(max_task_metric_drop=0.1, min_task_metric=0.7), c)
    by_key = {ch.key: ch for ch in checks}
    assert by_key["max_task_metric_drop"].value == pytest.approx(0.25)
    assert not by_key["max_task_metric_drop"].passed and by_key["min_task_metric"].passed


def pair_data(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pairs of 8-d embeddings whose cosine falls as the pair's score falls."""
    scores = rng.permutation(np.linspace(0.0, 10.0, n))
    base = rng.normal(size=(n, 8))
    other = base + (10.0 - scores)[:, None] * 0.3 * rng.normal(size=(n, 8))
    emb = np.stack([base, other], axis=1).reshape(2 * n, 8)
    labels = np.repeat(np.stack([np.arange(n), scores], axis=1), 2, axis=0)
    return emb, labels


def test_pair_spearman__ranks_pair_cosines_against_scores():
    emb, labels = pair_data(np.random.default_rng(0), 40)
    rho, pairs = pair_spearman(emb, labels)
    assert pairs == 40 and rho > 0.7
    perm = np.random.default_rng(1).permutation(len(emb))  # row order does not matter
    assert pair_spearman(emb[perm], labels[perm]) == (pytest.approx(rho), 40)
    rho_cut, pairs_cut = pair_spearman(emb[1:], labels[1:])  # a half pair is left out
    assert pairs_cut == 39 and rho_cut != rho
    assert np.isnan(pair_spearman(emb[:4], labels[:4])[0])  # two pairs rank nothing


def test_compare_embedding_pairs__spearman_as_task_metric():
    emb, labels = pair_data(np.random.default_rng(0), 40)
    noisy = emb + np.random.default_rng(2).normal(scale=0.5, size=emb.shape)
    c = compare_outputs(emb, noisy, task="embedding", labels=labels)
    assert c.compare["pairs"] == 40
    assert c.float_metrics["spearman"] > c.int8_metrics["spearman"]
    checks = {ch.key: ch for ch in check_thresholds(
        AccuracySection(max_task_metric_drop=0.001, min_task_metric=0.0), c)}
    drop = c.float_metrics["spearman"] - c.int8_metrics["spearman"]
    assert checks["max_task_metric_drop"].value == pytest.approx(drop)
    assert checks["max_task_metric_drop"].note == "spearman drop"
    assert not checks["max_task_metric_drop"].passed and checks["min_task_metric"].passed
    plain = compare_outputs(emb, noisy, task="embedding", labels=None)
    assert "spearman" not in plain.float_metrics and "pairs" not in plain.compare

"""Accuracy metrics and recipe thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.accuracy.metrics import SQNR_CAP_DB, compare_outputs, sqnr_db, topk_agreement
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

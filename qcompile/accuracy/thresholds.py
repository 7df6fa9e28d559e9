"""Recipe accuracy thresholds checked against a :class:`Comparison`.

A threshold whose metric was not measured (top-1 agreement on an embedding model, a task metric on
unlabelled data) fails with that reason: a gate that silently passes would be worse than none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qcompile.accuracy.metrics import Comparison

# recipe key -> (where the value lives, metric name, "min" or "max")
_RULES = {
    "min_sqnr_db": ("compare", "sqnr_db", "min"),
    "min_cosine": ("compare", "cosine", "min"),
    "min_top1_agreement": ("compare", "top1_agreement", "min"),
    "min_top5_agreement": ("compare", "top5_agreement", "min"),
    "max_abs_error": ("compare", "max_abs", "max"),
    "min_task_metric": ("int8", "task", "min"),
    "max_task_metric_drop": ("drop", "task", "max"),
}


@dataclass(frozen=True)
class Check:
    key: str
    threshold: float
    value: float | None
    passed: bool
    note: str = ""


def task_metric(metrics: dict[str, float]) -> tuple[str, float] | None:
    """The task metric of a side (``accuracy`` for labelled classification)."""
    for name in ("accuracy", "pearson", "spearman"):
        if name in metrics:
            return name, metrics[name]
    return None


def check_thresholds(accuracy: Any, comparison: Comparison) -> list[Check]:
    """One :class:`Check` per threshold set in the recipe's ``accuracy`` section."""
    checks = []
    for key, (where, metric, kind) in _RULES.items():
        threshold = getattr(accuracy, key)
        if threshold is None:
            continue
        value, note = _value(where, metric, comparison)
        if value is None:
            checks.append(Check(key, threshold, None, False, note))
            continue
        passed = value >= threshold if kind == "min" else value <= threshold
        checks.append(Check(key, threshold, value, passed, note))
    return checks


def _value(where: str, metric: str, c: Comparison) -> tuple[float | None, str]:
    if where == "compare":
        if metric not in c.compare:
            return None, f"'{metric}' is not measured for this model's task"
        return c.compare[metric], ""
    f, q = task_metric(c.float_metrics), task_metric(c.int8_metrics)
    if q is None or f is None:
        return None, "no task metric: the evaluation data has no labels for this task"
    if where == "int8":
        return q[1], q[0]
    return f[1] - q[1], f"{q[0]} drop"


def checks_as_dicts(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]

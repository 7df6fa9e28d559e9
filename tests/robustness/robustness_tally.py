"""Counts of what the robustness suite exercised, printed at the end of a run (see conftest.py).

Tests record distinct case ids per category and one tick per hypothesis example; a fuzz body that
meets an exception type it does not expect records it under ``unexpected`` before re-raising.
"""

from __future__ import annotations

from collections import Counter, defaultdict

# category -> minimum the acceptance asks for when the whole package runs
MINIMUMS = {"corrupted-artifact cases": 20, "bad-recipe cases": 20, "run-time input cases": 10}
MIN_EXAMPLES = 200

examples: Counter[str] = Counter()                 # hypothesis property -> examples run
cases: defaultdict[str, set[str]] = defaultdict(set)  # category -> distinct case ids
unexpected: list[str] = []                         # "ExceptionType in <where>"
totals: Counter[str] = Counter()                   # anything else worth a number


def example(prop: str) -> None:
    examples[prop] += 1


def case(category: str, case_id: str) -> None:
    cases[category].add(case_id)


def count(what: str, n: int = 1) -> None:
    totals[what] += n


def record_unexpected(err: BaseException, where: str) -> None:
    unexpected.append(f"{type(err).__name__} in {where}: {str(err)[:120]}")


def fuzz_settings(examples: int = MIN_EXAMPLES):  # type: ignore[no-untyped-def]
    """Hypothesis settings of every property here: reproducible (derandomized), no deadline."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

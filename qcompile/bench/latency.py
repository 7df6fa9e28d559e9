"""Median latency of callables, measured interleaved so that machine noise hits every engine
alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10
              ) -> dict[str, dict[str, float]]:
    """``{name: {median, p10, p90}}`` in milliseconds; rounds alternate between the engines."""
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: _summary(v) for k, v in samples.items()}


def _summary(v: list[float]) -> dict[str, float]:
    s = sorted(v)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median": round(statistics.median(s), 3), "p10": round(pick(0.1), 3),
            "p90": round(pick(0.9), 3)}

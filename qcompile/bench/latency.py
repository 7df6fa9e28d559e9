"""Median latency of callables, measured in rotating blocks so that machine noise hits every
engine alike.

Engines are not interleaved call by call: torch's OpenMP pool, ONNX Runtime's and IREE's task
system each spin for a while after a call, and the next engine's first call would pay for that.
Instead each window runs every engine for a block (one untimed call, then timed calls), and the
block order rotates from window to window.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10,
              windows: int = 3) -> dict[str, dict[str, float]]:
    """``{name: {median, p10, p90}}`` in milliseconds over ``repeats`` timed calls each."""
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in names}
    per_block = max(1, -(-repeats // windows))
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        for w in range(windows):
            for name in names[w % len(names):] + names[:w % len(names)]:
                fn = fns[name]
                fn()
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: _summary(v) for k, v in samples.items()}


def _summary(v: list[float]) -> dict[str, float]:
    s = sorted(v)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"median": round(statistics.median(s), 3), "p10": round(pick(0.1), 3),
            "p90": round(pick(0.9), 3)}

"""Fusion-aware accuracy fallback: when the int8 model misses a recipe threshold, keep the fewest,
cheapest fused chains in float until every threshold holds.

A candidate is the module of a fused chain's anchor (a conv or linear); keeping it in float is
quantizing with that module on the quantizer's skip list. Each round tries every remaining
candidate (at most ``limit`` of them, the chains whose output PT2E puts furthest from float first):
quantize with it skipped, run the reference on the evaluation data, check the thresholds, and
estimate the speed from the lowered QIR. The estimate is fusion-aware because it is read off the
graph the compiler would build: a float conv costs its MACs at float rate, and the chains it
breaks cost too — the conversions around it, the float bytes of the island, a residual add or a
neighbour that can no longer fuse and falls back with it. A round keeps the candidate that passes
at the lowest cost or, when none passes yet, the one with the largest shortfall reduction per
unit of cost; the search stops when the thresholds hold or after ``max_float`` modules.

The chosen configuration is compiled with the full-int8 one (target ``cpu`` by default) and
their latencies measured side by side: the speed paid, beside the estimate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qcompile.accuracy.metrics import compare_outputs
from qcompile.accuracy.thresholds import _RULES, check_thresholds, checks_as_dicts
from qcompile.frontend.quantize import QuantizeConfig, QuantizedModel, quantize
from qcompile.passes.why_not_faster import why_not_faster
from qcompile.recipe import Recipe

log = logging.getLogger("qcompile")

# relative cost of the estimate: int8 MACs run ~4x the float32 rate on VNNI/dot-product cores;
# moving a byte costs about as much as 4 int8 MACs; a quantize/dequantize inside the graph is a
# pass over its tensor (counted in bytes) plus a fixed overhead
INT8_MAC, FLOAT_MAC, BYTE, CONVERSION = 1.0, 4.0, 4.0, 2000.0


@dataclass
class Trial:
    skip: tuple[str, ...]
    compare: dict[str, float]
    checks: list[Any]
    cost: float
    shortfall: float
    q: QuantizedModel

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def summary(self, base_cost: float) -> dict[str, Any]:
        return {"kept_in_float": list(self.skip), "passed": self.passed,
                "sqnr_db": round(self.compare["sqnr_db"], 3),
                "shortfall": round(self.shortfall, 4),
                "estimated_cost": round(self.cost / base_cost, 4),
                "failed": [c.key for c in self.checks if not c.passed]}


def estimated_cost(graph: Any) -> float:
    r = why_not_faster(graph)
    return (INT8_MAC * r["macs"]["int8"] + FLOAT_MAC * r["macs"]["float"]
            + BYTE * r["bytes_moved"]["activations_total"]
            + CONVERSION * r["conversions"]["inside"])


def shortfall(checks: list[Any]) -> float:
    """How far the failed thresholds are missed, each relative to its threshold (0: all hold)."""
    total = 0.0
    for c in checks:
        if c.passed:
            continue
        if c.value is None:
            total += 1.0
            continue
        kind = _RULES[c.key][2]
        miss = c.threshold - c.value if kind == "min" else c.value - c.threshold
        total += max(0.0, miss) / max(abs(c.threshold), 1e-6)
    return total


class Search:
    def __init__(self, recipe: Recipe) -> None:
        from qcompile.pipeline import build_model, calibration_batches

        self.recipe = recipe
        self.mut = build_model(recipe)
        self.calib = lambda: calibration_batches(recipe, self.mut)   # a fresh stream a trial
        self.config = QuantizeConfig.from_recipe(recipe)
        self._eval: tuple[list[Any], np.ndarray] | None = None
        self.trials = 0

    def evaluate(self, skip: tuple[str, ...]) -> Trial:
        from qcompile.pipeline import _labels, evaluation_batches, run_batches
        from qcompile.reference.program import ReferenceProgram

        q = quantize(self.mut.module, self.mut.example_inputs(), self.calib(),
                     replace(self.config, skip=tuple(skip)))
        if self._eval is None:
            batches = evaluation_batches(self.recipe, self.mut, q)
            self._eval = batches, run_batches(self.mut.module, batches, "float", False)
        batches, float_out = self._eval
        program = ReferenceProgram(q)
        out = run_batches(program, batches, "reference", False)
        comparison = compare_outputs(float_out, out, task=self.mut.task,
                                     labels=_labels(batches))
        checks = check_thresholds(self.recipe.accuracy, comparison)
        cost = estimated_cost(program.graph(int(batches[0].inputs[0].shape[0])))
        self.trials += 1
        return Trial(tuple(skip), comparison.compare, checks, cost, shortfall(checks), q)


def candidates(q: QuantizedModel, module_names: set[str], limit: int) -> list[str]:
    """Modules of the fused chains' anchors, lowest SQNR of PT2E's chain output against float
    first (from the attribution, on the example inputs)."""
    from qcompile.accuracy.attribution import attribution
    from qcompile.reference.program import lower

    x = q.example_inputs
    rows = attribution(lower(q, int(x[0].shape[0])).graph, q, x)["chains"]
    scored: dict[str, float] = {}
    for r in rows:
        words = (r["loc"] or "").split()
        module = words[1] if len(words) == 3 else None
        if module in module_names:
            score = r["pt2e_sqnr_vs_float_db"]
            scored[module] = min(scored.get(module, 1e9), 1e9 if score is None else score)
    return sorted(scored, key=scored.__getitem__)[:limit]


def search(recipe: Recipe, *, max_float: int = 3, limit: int = 8,
           measure_on: str | None = "cpu") -> dict[str, Any]:
    """The fallback search (module docstring); returns its report."""
    t0 = time.perf_counter()
    s = Search(recipe)
    base = s.evaluate(tuple(s.config.skip))
    names = {n for n, _ in s.mut.module.named_modules() if n}
    pool = [m for m in candidates(base.q, names, limit) if m not in base.skip]
    ranked = list(pool)
    rounds: list[dict[str, Any]] = []
    best = base
    while not best.passed and len(best.skip) - len(base.skip) < max_float and pool:
        tried = [s.evaluate((*best.skip, m)) for m in pool]
        rounds.append({"from": list(best.skip),
                       "tried": [t.summary(base.cost) for t in tried]})
        choice = _choose(best, tried)
        if choice is None:
            break
        best = choice
        pool = [m for m in pool if m not in best.skip]
    report: dict[str, Any] = {
        "recipe": recipe.name, "passed": best.passed,
        "kept_in_float": [m for m in best.skip if m not in base.skip],
        "before": base.summary(base.cost), "after": best.summary(base.cost),
        "checks": checks_as_dicts(best.checks), "candidates": ranked,
        "rounds": rounds, "trials": s.trials, "search_s": round(time.perf_counter() - t0, 2)}
    if measure_on and best is not base:
        report["latency_ms"] = _measure(base.q, best.q, recipe, measure_on)
    return report


def _choose(current: Trial, tried: list[Trial]) -> Trial | None:
    passing = [t for t in tried if t.passed]
    if passing:
        return min(passing, key=lambda t: t.cost)
    better = [t for t in tried if t.shortfall < current.shortfall]
    if not better:
        return None
    return max(better, key=lambda t: (current.shortfall - t.shortfall)
               / max(t.cost - current.cost, 1e-9 * current.cost))


def _measure(int8: QuantizedModel, fallback: QuantizedModel, recipe: Recipe, target: str
             ) -> dict[str, Any]:
    """On ``target``, or on ``ort`` (with the reason) when ``target`` cannot build both."""
    from qcompile.errors import QCompileError

    try:
        return measured_latency(int8, fallback, recipe, target)
    except QCompileError as err:
        if target == "ort":
            raise
        log.warning("fallback: measuring on ort, %s cannot build the models: %s", target,
                    str(err).splitlines()[0])
        return {**measured_latency(int8, fallback, recipe, "ort"),
                "not_on": {target: str(err).splitlines()[0]}}


def measured_latency(int8: QuantizedModel, fallback: QuantizedModel, recipe: Recipe,
                     target: str = "cpu") -> dict[str, Any]:
    """Median ms of both models on ``target`` (``cpu``: IREE, what qcompile ships; ``ort``:
    quicker to build, but its int64 requantize makes int8 slower than float there) at the
    evaluation batch, side by side."""
    from qcompile.bench.latency import median_ms
    from qcompile.codegen.target import CompileOptions
    from qcompile.reference.program import example_batch
    from qcompile.targets import compile_quantized

    batch = recipe.evaluation.batch_size if int8.dynamic_batch else \
        int(int8.example_inputs[0].shape[0])
    x = example_batch(int8, batch)
    options = CompileOptions(batch_sizes=(batch,), analyze=False)
    models = {name: compile_quantized(q, target, options)
              for name, q in (("int8", int8), ("fallback", fallback))}
    times = median_ms({name: (lambda m=m: m(*x)) for name, m in models.items()})
    return {"target": target, "batch": batch, **times,
            "slowdown": round(times["fallback"]["median"] / times["int8"]["median"], 3)}


def text(r: dict[str, Any]) -> list[str]:
    b, a = r["before"], r["after"]
    lines = [f"{r['recipe']}: full int8 {'passes' if b['passed'] else 'fails'} "
             f"(sqnr {b['sqnr_db']:.2f} dB, failed: {', '.join(b['failed']) or 'none'})"]
    for i, rnd in enumerate(r["rounds"]):
        tried = ", ".join(f"{t['kept_in_float'][-1]} ({t['sqnr_db']:.1f} dB, cost "
                          f"{t['estimated_cost']:.3f}{', passes' if t['passed'] else ''})"
                          for t in rnd["tried"])
        lines.append(f"  round {i + 1}: tried {tried}")
    verdict = "thresholds hold" if a["passed"] else "thresholds still fail"
    lines.append(f"kept in float: {', '.join(r['kept_in_float']) or 'nothing'}; {verdict} (sqnr "
                 f"{a['sqnr_db']:.2f} dB); estimated cost {a['estimated_cost']:.3f}x of full "
                 f"int8")
    if "latency_ms" in r:
        lat = r["latency_ms"]
        lines.append(f"measured on {lat['target']} at batch {lat['batch']}: int8 "
                     f"{lat['int8']['median']} ms, with fallback {lat['fallback']['median']} ms "
                     f"({lat['slowdown']}x)" + "".join(f"; not on {t}: {why}" for t, why in
                                                       lat.get("not_on", {}).items()))
    return lines

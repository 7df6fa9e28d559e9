"""``qcompile bench RECIPE``: qcompile's ``cpu`` target against the engines users would pick
instead, measured in one run on one machine.

For each batch size: wait for a quiet machine (bounded), then time every engine in interleaved
rounds after warm-up and keep medians with p10/p90. The int8 ceiling of these cores
(``torch._int_mm`` on 1024³, oneDNN) is timed in the same rounds, as one more engine: it is the
cell that shows interference the load average does not (another tenant's work on the host), so
when its p90 exceeds 1.25× its p10 every cell of that batch size is flagged noisy. A cell whose
own p90 exceeds 1.5× its p10, or whose window saw a load above the core count, is flagged too.
Reported: ratios (peer median / qcompile median: above 1 means qcompile is faster), achieved GOPS
of the int8 contractions, their fraction of the measured ceiling, build/compile time and peak-RSS
growth per engine, and a per-dispatch profile of qcompile's module.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qcompile.bench.latency import median_ms
from qcompile.bench.peers import BUILDERS, Context, PeerUnavailable, threads
from qcompile.ir.graph import Graph, Op
from qcompile.recipe import Recipe

NOISY_SPREAD = 1.5
CEILING_SPREAD = 1.25      # the probe is one fixed GEMM: a wider spread is the host, not it
CEILING_SIZE = 1024
CEILING = "int8_ceiling"   # the probe's name among the engines while timing
INT8_ENGINES = ("qcompile", "ort_int8", "ort_int8_dynamic", "pt2e_inductor_int8")


def int8_ops(graph: Graph) -> int:
    """2 × multiply-accumulates of the int8 contractions (conv, linear, matmul)."""
    total = 0
    for n in graph.nodes():
        if n.op is Op.QCONV2D:
            w = n.src[1].shape
            total += 2 * int(np.prod(n.shape)) * w[1] * w[2] * w[3]
        elif n.op is Op.QLINEAR:
            total += 2 * int(np.prod(n.shape)) * n.src[1].shape[1]
        elif n.op is Op.QMATMUL:
            total += 2 * int(np.prod(n.shape)) * n.src[0].shape[-1]
    return total


def ceiling_probe(size: int = CEILING_SIZE) -> Any:
    """One int8 GEMM (``torch._int_mm``, size³): the cores' int8 ceiling, timed like an engine."""
    a = torch.randint(-128, 127, (size, size), dtype=torch.int8)
    b = torch.randint(-128, 127, (size, size), dtype=torch.int8)
    return lambda: torch._int_mm(a, b)


def ceiling_gops(ms: float, size: int = CEILING_SIZE) -> float:
    return 2 * size**3 / (ms / 1e3) / 1e9


def wait_quiet(max_wait_s: float) -> float:
    """Wait until the 1-minute load falls below the core count (at most ``max_wait_s``)."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= os.cpu_count() and time.monotonic() < deadline:  # type: ignore
        time.sleep(2.0)
    return os.getloadavg()[0]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(calibration: list[tuple[torch.Tensor, ...]], batch: int) -> tuple[torch.Tensor, ...]:
    joined = [torch.cat([b[i] for b in calibration]) for i in range(len(calibration[0]))]
    reps = -(-batch // joined[0].shape[0])
    return tuple(x.repeat(reps, *([1] * (x.dim() - 1)))[:batch].contiguous() for x in joined)


def build_engines(ctx: Context, peers: list[str], progress: bool) -> tuple[dict, dict]:
    engines: dict[str, Any] = {}
    info: dict[str, Any] = {}
    from tqdm import tqdm

    for name in tqdm(peers, desc="build engines", disable=not progress, leave=False):
        rss0, t0 = _peak_rss_mb(), time.perf_counter()
        try:
            fn = BUILDERS[name](ctx)
            with torch.no_grad():
                for b in ctx.batch_sizes:      # first calls compile (torch.compile, Inductor)
                    fn(*_inputs(ctx.calibration, b))
        except PeerUnavailable as err:
            info[name] = {"status": "unavailable", "reason": str(err)}
            continue
        except Exception as err:  # a peer that breaks is reported, the bench goes on
            info[name] = {"status": "failed", "reason": f"{type(err).__name__}: {err}"[:500]}
            continue
        engines[name] = fn
        info[name] = {"status": "ok", "build_s": round(time.perf_counter() - t0, 2),
                      "peak_rss_growth_mb": round(_peak_rss_mb() - rss0, 1)}
    return engines, info


def run_bench(recipe: Recipe, *, peers: list[str] | None = None,
              batch_sizes: list[int] | None = None, repeats: int | None = None,
              warmup: int | None = None, quiet_wait_s: float = 60.0, profile: bool = True,
              progress: bool = True) -> dict[str, Any]:
    from qcompile.frontend.quantize import QuantizeConfig, quantize
    from qcompile.pipeline import build_model, calibration_batches

    bench = recipe.benchmark
    sizes = tuple(batch_sizes or bench.batch_sizes)
    mut = build_model(recipe)
    calib = list(calibration_batches(recipe, mut))   # every batch: the benchmark inputs
    q = quantize(mut.module, mut.example_inputs(), calib, QuantizeConfig.from_recipe(recipe))
    # The peers' files (ONNX models, ~150 MB for resnet50) live only as long as the run.
    with tempfile.TemporaryDirectory(prefix="qcompile-bench-",
                                     dir=os.environ.get("TMPDIR")) as tmp:
        ctx = Context(mut.module, q, [b.inputs for b in calib], sizes, tuple(mut.spec.names),
                      Path(tmp))
        return _run(recipe, mut, ctx, list(peers or bench.peers), warmup, repeats, quiet_wait_s,
                    profile, progress)


def _run(recipe: Recipe, mut: Any, ctx: Context, names: list[str], warmup: int | None,
         repeats: int | None, quiet_wait_s: float, profile: bool,
         progress: bool) -> dict[str, Any]:
    from qcompile.pipeline import versions

    bench = recipe.benchmark
    if "qcompile" not in names:
        names.append("qcompile")
    engines, info = build_engines(ctx, names, progress)
    results = []
    for b in ctx.batch_sizes:
        load = wait_quiet(quiet_wait_s)
        x = _inputs(ctx.calibration, b)
        fns = {k: (lambda fn=fn, x=x: fn(*x)) for k, fn in engines.items()}
        times = median_ms(fns | {CEILING: ceiling_probe()},
                          warmup=warmup if warmup is not None else bench.warmup,
                          repeats=repeats if repeats is not None else bench.repeats)
        load_after = os.getloadavg()[0]
        results.append(_batch_row(b, times, max(load, load_after), engines.get("qcompile")))
    report = {"recipe": recipe.name, "model": mut.name, "threads": threads(),
              "cores": os.cpu_count(), "versions": versions(), "engines": info,
              "batches": results, "summary": _summary(results)}
    if profile and "qcompile" in engines:
        report["profile"] = _profile(engines["qcompile"], ctx)
    return report


def _batch_row(b: int, times: dict[str, Any], load: float, qc: Any) -> dict[str, Any]:
    """One batch size's cells; ``times`` holds the engines' and the ceiling probe's."""
    times = dict(times)
    probe = times.pop(CEILING)
    ceiling = ceiling_gops(probe["median"])
    # the probe's fastest and slowest tenth: how far the host moved under the timed windows
    ceiling_range = [round(ceiling_gops(probe["p90"]), 1), round(ceiling_gops(probe["p10"]), 1)]
    host_unsteady = probe["p90"] > CEILING_SPREAD * probe["p10"]
    ops = int8_ops(qc.runner.modules[min(qc.runner.modules)].graph) * b // min(
        qc.runner.modules) if qc is not None else 0
    cells = {}
    for name, t in times.items():
        cell = {**t, "noisy": host_unsteady or t["p90"] > NOISY_SPREAD * t["p10"]
                or load >= (os.cpu_count() or 1)}
        if name in INT8_ENGINES and ops:
            gops = ops / (t["median"] / 1e3) / 1e9
            cell |= {"gops": round(gops, 1), "fraction_of_ceiling": round(gops / ceiling, 3)}
        cells[name] = cell
    ratios = {}
    if "qcompile" in times:
        mine = times["qcompile"]["median"]
        ratios = {k: round(t["median"] / mine, 3) for k, t in times.items() if k != "qcompile"}
    return {"batch": b, "int8_ceiling_gops": round(ceiling, 1),
            "int8_ceiling_range_gops": ceiling_range, "host_unsteady": host_unsteady,
            "load": round(load, 2),
            "int8_gops_per_inference": round(ops / b / 1e9, 3) if b else 0, "ms": cells,
            "qcompile_speedup_vs": ratios}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """qcompile against the best int8 peer per batch size."""
    out = {}
    for r in rows:
        peers = {k: v["median"] for k, v in r["ms"].items() if k in INT8_ENGINES
                 and k != "qcompile"}
        if "qcompile" not in r["ms"] or not peers:
            continue
        best = min(peers, key=peers.__getitem__)
        out[f"batch_{r['batch']}"] = {"best_int8_peer": best,
                                      "speedup_vs_best_int8": round(
                                          peers[best] / r["ms"]["qcompile"]["median"], 3)}
    return out


def _profile(model: Any, ctx: Context) -> dict[str, Any]:
    from qcompile.bench.profile import dispatch_profile

    b = min(model.runner.modules)
    try:
        return dispatch_profile(model.runner.modules[b],
                                [x.numpy() for x in _inputs(ctx.calibration, b)])
    except Exception as err:  # profiling is a diagnostic: its failure is reported
        return {"status": "failed", "reason": f"{type(err).__name__}: {err}"[:500]}


def write_bench(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import json

    from qcompile.report.writer import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md", out_dir / "bench.png"]
    atomic_write_text(paths[0], json.dumps(report, indent=2, allow_nan=False) + "\n")
    atomic_write_text(paths[1], render_markdown(report))
    _chart(report, paths[2])
    return paths


def render_markdown(r: dict[str, Any]) -> str:
    lines = [f"# qcompile bench: {r['recipe']}", "",
             f"{r['cores']} cores, {r['threads']} threads; medians of interleaved rounds (ms); "
             "`*` = noisy cell.", ""]
    for row in r["batches"]:
        lo, hi = row["int8_ceiling_range_gops"]
        lines += [f"## batch {row['batch']} (int8 ceiling {row['int8_ceiling_gops']} GOPS, "
                  f"p10–p90 {lo}–{hi}; load {row['load']})", ""]
        if row["host_unsteady"]:
            lines += [f"The ceiling probe moved by more than {CEILING_SPREAD}× across the timed "
                      "windows: the host was busy, so every cell here is flagged noisy.", ""]
        lines += [
                  "| engine | median ms | p10 | p90 | GOPS | of ceiling | qcompile speedup |",
                  "|---|---|---|---|---|---|---|"]
        for name, c in row["ms"].items():
            mark = "*" if c["noisy"] else ""
            lines.append(f"| {name} | {c['median']}{mark} | {c['p10']} | {c['p90']} | "
                         f"{c.get('gops', '—')} | {c.get('fraction_of_ceiling', '—')} | "
                         f"{row['qcompile_speedup_vs'].get(name, '—')} |")
        lines.append("")
    lines += ["## Engines", ""]
    for name, e in r["engines"].items():
        lines.append(f"- {name}: {e['status']}" + (f" ({e['reason']})" if "reason" in e else
                                                 f", build {e['build_s']} s, peak RSS +"
                                                 f"{e['peak_rss_growth_mb']} MB"))
    if "profile" in r and "top" in r["profile"]:
        p = r["profile"]
        lines += ["", f"## qcompile dispatch profile (batch {p['batch']}, {p['dispatches']} "
                  f"dispatches; time share by kind {p['share_by_kind']})", "",
                  "| dispatch | share | chain |", "|---|---|---|"]
        lines += [f"| {d['dispatch']} | {d['share']} | {d['chain'] or '—'} |" for d in p["top"]]
    return "\n".join(lines) + "\n"


def _chart(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["batches"]
    names = sorted({n for row in rows for n in row["ms"]})
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        vals = [row["ms"].get(n, {}).get("median", 0) for n in names]
        ax.barh(names, vals, color=["tab:red" if n == "qcompile" else "tab:gray" for n in names])
        ax.set_title(f"{r['recipe']} batch {row['batch']}")
        ax.set_xlabel("median latency (ms)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)

#!/usr/bin/env python
"""One-shot check of target ``cuda`` on a machine with an NVIDIA GPU (sm_80 or newer).

For each zoo CNN (digits_cnn, resnet18, mobilenet_v2, efficientnet_lite0) at batch 1 and 8:
quantize with qcompile's PT2E quantizer, build the Triton programs for the GPU found, run them on
real inputs and compare every output bit for bit with the reference interpreter, then time them
(median ms, CUDA events) beside torch eager fp32 and fp16 and ``torch.compile`` fp16 of the float
model. Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

Designed to finish in about 8 minutes on an H200: the exactness and eager timings of every model
come first; the ``torch.compile`` peers run last and are skipped (and reported as skipped) once
``--budget-s`` is spent. Without a usable GPU it prints why and exits with status 2.

    python scripts/gpu_check.py --out out/gpu_check
    python scripts/gpu_check.py --interpret --models digits_cnn --batches 1   # logic only, CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODELS = ("digits_cnn", "resnet18", "mobilenet_v2", "efficientnet_lite0")
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def median_ms(fn: Callable[[], Any], cuda: bool, min_iters: int = 20, max_s: float = 2.0
              ) -> dict[str, float]:
    """Median and p90 latency of ``fn`` after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start_all < 0.2 and len(times) < 500):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() - start_all > max_s and len(times) >= 5:
            break
    times.sort()
    return {"median": round(statistics.median(times), 4),
            "p90": round(times[int(0.9 * (len(times) - 1))], 4), "iters": len(times)}


def cuda_graph(program: Any, x: torch.Tensor) -> Callable[[], Any]:
    """A CUDA graph replaying every launch of ``program`` on a static copy of ``x``."""
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        program.run_device([static])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = program.run_device([static])

    def replay() -> Any:
        graph.replay()
        return outs

    return replay


def inputs_for(z: Any, batch: int) -> torch.Tensor:
    import calibration

    reader = calibration.get_reader(z.default_dataset)
    data = next(iter(reader.batches(z.spec, batch_size=max(batch, 8), num_batches=1,
                                    split="evaluation")))
    return data.inputs[0][:batch].contiguous()


def check_model(name: str, batches: list[int], interpret: bool, device: torch.device
                ) -> tuple[dict[str, Any], Any]:
    """Quantize, compile, check exactness and time one model; returns its row and state for
    the torch.compile peers."""
    import calibration
    from qcompile import zoo
    from qcompile.codegen.target import CompileOptions
    from qcompile.codegen.triton.target import CudaOptions, compile_cuda
    from qcompile.frontend.quantize import QuantizeConfig, quantize
    from qcompile.reference import interpreter

    row: dict[str, Any] = {"model": name, "batches": {}}
    t = time.perf_counter()
    z = zoo.build(name)
    reader = calibration.get_reader(z.default_dataset)
    cal = list(reader.batches(z.spec, batch_size=8, num_batches=2, split="calibration"))
    q = quantize(z.module, z.example_inputs(1), cal, QuantizeConfig(quantizer="qcompile"))
    row["quantize_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    model = compile_cuda(q, CompileOptions(batch_sizes=tuple(batches)),
                         CudaOptions(interpret=interpret))
    row["build_s"] = round(time.perf_counter() - t, 2)
    row["kernels"] = {k: model.report["kernels"][k] for k in
                      ("total", "fused_chains", "by_kernel", "torch_ops", "host_ops")}
    row["residency"] = model.report["residency"].get("int8_bytes_fraction")
    m32 = copy.deepcopy(z.module).eval().to(device)
    m16 = copy.deepcopy(z.module).eval().half().to(device) if device.type == "cuda" else None
    for b in batches:
        log(f"{name} batch {b}")
        x = inputs_for(z, b)
        program, graph = model.runner.programs[b], model.runner.graphs[b]
        entry: dict[str, Any] = {}
        xd = x.to(device)
        t = time.perf_counter()
        got = [o.cpu().numpy() for o in program.run_device([xd])]  # JIT ran in build_s
        entry["first_run_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        want = interpreter.run(graph, x.numpy())
        entry["reference_s"] = round(time.perf_counter() - t, 2)
        mismatched = sum(int(np.sum(g != w)) for g, w in zip(got, want, strict=True))
        entry["exact"] = {"mismatched": mismatched, "total": int(sum(w.size for w in want))}
        with torch.no_grad():
            ref_fp32 = m32(xd).float().cpu()
        logits = torch.from_numpy(np.asarray(got[0], dtype=np.float32))
        if logits.ndim == 2:
            entry["top1_agreement_vs_fp32"] = float(
                (logits.argmax(1) == ref_fp32.argmax(1)).float().mean())
        entry["latency_ms"] = time_peers(program, m32, m16, xd)
        row["batches"][str(b)] = entry
    return row, (z, m16)


def time_peers(program: Any, m32: Any, m16: Any, xd: torch.Tensor) -> dict[str, Any]:
    """qcompile (launches from Python, and replayed as one CUDA graph), eager fp32 and fp16."""
    cuda = xd.device.type == "cuda"
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["qcompile"] = median_ms(lambda: program.run_device([xd]), cuda) if cuda else {
            "skipped": "Triton interpreter (first_run_s is one interpreted run)"}
        if cuda and not any(s.kind == "host" for s in program.steps):
            out["qcompile_cuda_graph"] = attempt(lambda: median_ms(cuda_graph(program, xd), cuda))
        out["eager_fp32"] = median_ms(lambda: m32(xd), cuda)
        if m16 is not None:
            x16 = xd.half()
            out["eager_fp16"] = median_ms(lambda: m16(x16), cuda)
    return out


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as err:       # a peer that fails is reported, the check goes on
        return {"error": f"{type(err).__name__}: {err}"[:500]}


def compile_peers(rows: list[dict[str, Any]], states: dict[str, Any], batches: list[int],
                  device: torch.device, budget_s: float) -> None:
    """``torch.compile`` fp16 of every model, while the time budget lasts."""
    for row in rows:
        name = row["model"]
        if name not in states:
            continue
        z, m16 = states[name]
        for b in batches:
            lat = row["batches"].get(str(b), {}).get("latency_ms")
            if lat is None:
                continue
            if elapsed() > budget_s:
                lat["compile_fp16"] = {"skipped": f"time budget {budget_s:.0f} s spent"}
                continue
            log(f"{name} batch {b}: torch.compile fp16")
            x16 = inputs_for(z, b).to(device).half()

            def run(m16: Any = m16, x16: torch.Tensor = x16) -> dict[str, Any]:
                torch._dynamo.reset()
                compiled = torch.compile(m16, dynamic=False)
                t = time.perf_counter()
                with torch.no_grad():
                    compiled(x16)
                    compile_s = round(time.perf_counter() - t, 1)
                    return {**median_ms(lambda: compiled(x16), True), "compile_s": compile_s}

            lat["compile_fp16"] = attempt(run)


def environment(device: torch.device, interpret: bool) -> dict[str, Any]:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "mode": "interpreted" if interpret else "compiled",
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability()
        env.update(gpu=torch.cuda.get_device_name(), capability=f"sm_{cap[0]}{cap[1]}",
                   cuda=torch.version.cuda)
    return env


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    where = f"{env['gpu']} ({env['capability']})" if "gpu" in env else \
        "no GPU: Triton's CPU interpreter (latencies are not GPU figures)"
    lines = ["# qcompile gpu_check", "",
             f"- {where}, torch {env['torch']}, triton {env['triton']}, CUDA "
             f"{env.get('cuda', '-')}, {env['date']}; total {report['total_s']} s", "",
             "| model | batch | exact (mismatched / total) | kernels | qcompile ms | "
             "qcompile CUDA graph ms | eager fp32 ms | eager fp16 ms | torch.compile fp16 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["models"]:
        if "error" in row:
            lines.append(f"| {row['model']} | - | failed: {row['error'][:200]} | | | | | | |")
            continue
        for b, e in row["batches"].items():
            lat = e["latency_ms"]
            cells = [_ms(lat.get(k)) for k in ("qcompile", "qcompile_cuda_graph", "eager_fp32",
                                               "eager_fp16", "compile_fp16")]
            ex = e["exact"]
            lines.append(f"| {row['model']} | {b} | {ex['mismatched']} / {ex['total']} | "
                         f"{row['kernels']['total']} | " + " | ".join(cells) + " |")
    lines += ["", "Host fallbacks: " + (", ".join(
        f"{r['model']}: {r['kernels']['host_ops']}" for r in report["models"]
        if r.get("kernels", {}).get("host_ops")) or "none"), ""]
    return "\n".join(lines)


def _ms(v: Any) -> str:
    if not isinstance(v, dict):
        return "-"
    if "median" in v:
        return f"{v['median']:.3f}"
    return str(v.get("skipped") or v.get("error", "-"))[:60]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/gpu_check"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="after this many seconds the torch.compile peers are skipped")
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels in Triton's CPU interpreter (checks this script only)")
    args = ap.parse_args(argv)
    from qcompile.codegen.triton.target import unavailable_reason

    reason = unavailable_reason(args.interpret)
    if reason is not None:
        print(f"gpu_check: target cuda cannot run here: {reason}", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.interpret else "cuda")
    rows: list[dict[str, Any]] = []
    states: dict[str, Any] = {}
    for name in args.models:
        log(f"{name}: quantize, build, check")
        try:
            row, state = check_model(name, args.batches, args.interpret, device)
            states[name] = state
        except Exception as err:
            row = {"model": name, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()[-4000:]}
            log(f"{name} failed: {row['error']}")
        rows.append(row)
    if device.type == "cuda":
        compile_peers(rows, states, args.batches, device, args.budget_s)
    report = {"environment": environment(device, args.interpret), "models": rows,
              "total_s": round(elapsed(), 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (args.out / "gpu_check.md").write_text(markdown(report))
    log(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    bad = [r["model"] for r in rows if "error" in r or any(
        e["exact"]["mismatched"] for e in r["batches"].values())]
    if bad:
        print(f"gpu_check: not bit-exact or failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``cpu`` target: a PT2E model → QIR per batch size → pass pipeline → MLIR → IREE modules,
wrapped in a :class:`CompiledModel` whose report carries passes, residency, compile times,
workarounds and the dispatch analysis."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from qcompile.codegen import cpu, iree_cpu, kernels
from qcompile.frontend.quantize import QuantizedModel
from qcompile.passes.residency import residency
from qcompile.runtime.compiled import CompiledModel, InputSignature


@dataclass(frozen=True)
class CompileOptions:
    """``batch_sizes``: the modules to build (1 is added for dynamic-batch models; other sizes run
    in pieces). ``float_ops``: the integer-only gate's policy. ``keep_dir``: where a failed
    compile leaves its MLIR (default: the current directory). ``analyze``: run the dispatch
    analysis (one extra ``--compile-to=flow`` per batch size). ``ukernel_convs``: lower conv
    chains to the AVX-512 VNNI microkernel (None: when the host has VNNI and gcc).
    ``winograd``: its 3x3 stride-1 convs as exact Winograd F(4x4, 3x3) where they fit."""

    batch_sizes: tuple[int, ...] = (1,)
    float_ops: str = "fallback"
    keep_dir: str | None = None
    analyze: bool = True
    ukernel_convs: bool | None = None
    winograd: bool = True


def batch_sizes(q: QuantizedModel, wanted: tuple[int, ...]) -> tuple[int, ...]:
    if not q.dynamic_batch:
        return (int(q.example_inputs[0].shape[0]),)
    return tuple(sorted({1, *(b for b in wanted if 1 <= b <= q.config.max_batch)}))


def signature(q: QuantizedModel) -> tuple[InputSignature, ...]:
    from qcompile.targets import signature_of

    return signature_of(q)


def compile_cpu(q: QuantizedModel, options: CompileOptions | None = None) -> CompiledModel:
    from qcompile.reference.program import lower

    options = options or CompileOptions()
    sizes = batch_sizes(q, options.batch_sizes)
    if q.dynamic_batch:
        # the data-parallel shards' size (cpu.shard_size) is compiled too
        shards = {k for b in sizes if (k := cpu.shard_size(b)) is not None}
        sizes = tuple(sorted({*sizes, *shards}))
    t0 = time.perf_counter()
    lowered = {b: lower(q, b, float_ops=options.float_ops) for b in sizes}
    lower_s = time.perf_counter() - t0
    runner, compile_report = cpu.build({b: r.graph for b, r in lowered.items()},
                                       keep_dir=options.keep_dir,
                                       ukernel_convs=options.ukernel_convs,
                                       winograd=options.winograd)
    first = lowered[sizes[0]]
    report: dict[str, Any] = {"passes": first.stats, "residency": residency(first.graph),
                              "compile": {**compile_report, "lower_s": round(lower_s, 3)}}
    if options.analyze:
        report["kernels"] = analyze_kernels(runner)
    return CompiledModel("cpu", signature(q), runner, report)


def analyze_kernels(runner: cpu.CpuRunner) -> dict[str, Any]:
    """The dispatch analysis of the largest compiled batch size, plus the per-batch totals."""
    per_batch: dict[str, Any] = {}
    for b, m in sorted(runner.modules.items()):
        if m.mlir is None or m.graph is None:
            continue
        flow = iree_cpu.compile_to_flow(m.mlir, m.flags)
        per_batch[str(b)] = kernels.analyze(m.graph, flow)
    if not per_batch:
        return {}
    main = per_batch[max(per_batch, key=int)]
    return {**main, "batch": int(max(per_batch, key=int)),
            "per_batch": {b: {k: r[k] for k in ("total", "max_per_chain", "i32_writes",
                                                "copy_dispatches")}
                          for b, r in per_batch.items()}}

"""The ``ort`` target: a PT2E model → QIR per batch size → pass pipeline → ONNX → ONNX Runtime
(CPUExecutionProvider), wrapped in a :class:`CompiledModel`.

QIR is static-shaped, so there is one ONNX model (one session) per compiled batch size, and a call
with another batch size runs in pieces, as on target ``cpu``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from qcompile.codegen.ort.export import export
from qcompile.codegen.target import batch_sizes
from qcompile.frontend.quantize import QuantizedModel
from qcompile.ir.graph import Graph
from qcompile.passes.residency import residency
from qcompile.runtime.compiled import CompiledModel


def unavailable_reason() -> str | None:
    try:
        import onnxruntime
    except ImportError as err:
        return f"onnxruntime is not installed ({err})"
    if "CPUExecutionProvider" not in onnxruntime.get_available_providers():
        return "this onnxruntime build has no CPUExecutionProvider"
    return None


@dataclass
class OrtModule:
    """One batch size: its QIR, the ONNX model, and the ONNX Runtime session (made on first
    use). ``module()`` is a callable numpy → list of numpy, like the cpu target's modules."""

    batch: int
    graph: Graph
    model: onnx.ModelProto
    threads: int = 0
    _session: Any = field(default=None, repr=False)

    def module(self) -> OrtModule:
        return self

    def session(self) -> Any:
        if self._session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = self.threads
            opts.log_severity_level = 3
            self._session = ort.InferenceSession(self.model.SerializeToString(), opts,
                                                 providers=["CPUExecutionProvider"])
        return self._session

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        feeds = {f"input_{i}": np.ascontiguousarray(x) for i, x in enumerate(inputs)}
        return list(self.session().run(None, feeds))


class OrtRunner:
    """Torch tensors in → pieces through the per-batch sessions → torch tensors out."""

    def __init__(self, modules: dict[int, OrtModule]) -> None:
        self.modules = modules

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        from qcompile.codegen.cpu import run_in_pieces

        return run_in_pieces(lambda size, xs: self.modules[size](*xs), inputs,
                             list(self.modules))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        raw = self.run_numpy(*[x.detach().contiguous().numpy() for x in inputs])
        outs = [torch.from_numpy(np.ascontiguousarray(r)) for r in raw]
        return outs[0] if len(outs) == 1 else tuple(outs)


def build(graphs: dict[int, Graph], *, threads: int = 0) -> tuple[OrtRunner, dict[str, Any]]:
    """Export one ONNX model per batch size and check it (``onnx.checker``); sessions are made
    here too, so a model ONNX Runtime rejects fails at compile time."""
    modules: dict[int, OrtModule] = {}
    times: dict[str, float] = {}
    for batch, graph in sorted(graphs.items()):
        t0 = time.perf_counter()
        model = export(graph)
        onnx.checker.check_model(model)
        modules[batch] = OrtModule(batch, graph, model, threads)
        modules[batch].session()
        times[str(batch)] = round(time.perf_counter() - t0, 3)
    first = modules[min(modules)].model
    import onnxruntime

    report = {"batch_sizes": sorted(modules), "compile_s_per_batch": times,
              "onnx": {"opset": first.opset_import[0].version, "nodes": len(first.graph.node),
                       "op_types": dict(Counter(n.op_type for n in first.graph.node)
                                        .most_common()),
                       "bytes": first.ByteSize()},
              "onnxruntime": onnxruntime.__version__}
    return OrtRunner(modules), report


def compile_ort(q: QuantizedModel, options: Any = None) -> CompiledModel:
    from qcompile.reference.program import lower
    from qcompile.targets import signature_of

    wanted = tuple(getattr(options, "batch_sizes", (1,)))
    float_ops = getattr(options, "float_ops", "fallback")
    sizes = batch_sizes(q, wanted)
    t0 = time.perf_counter()
    lowered = {b: lower(q, b, float_ops=float_ops) for b in sizes}
    lower_s = time.perf_counter() - t0
    runner, compile_report = build({b: r.graph for b, r in lowered.items()})
    first = lowered[sizes[0]]
    report: dict[str, Any] = {"passes": first.stats, "residency": residency(first.graph),
                              "compile": {**compile_report, "lower_s": round(lower_s, 3)}}
    return CompiledModel("ort", signature_of(q), runner, report)

"""The ``reference`` target: a PT2E model imported to QIR, run through the pass pipeline and
executed by the reference interpreter. QIR is static-shaped, so one graph is built per batch size
seen (cached)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from qcompile.frontend.importer import import_graph
from qcompile.frontend.quantize import QuantizedModel
from qcompile.ir.graph import Graph
from qcompile.passes.pipeline import PipelineResult, default_pipeline, run_pipeline
from qcompile.passes.residency import residency
from qcompile.reference import interpreter


def example_batch(q: QuantizedModel, batch: int) -> tuple[torch.Tensor, ...]:
    """Inputs of ``batch`` rows shaped like the model's example inputs (values do not matter)."""
    return tuple(x[:1].expand(batch, *x.shape[1:]).contiguous() for x in q.example_inputs)


def lower(q: QuantizedModel, batch: int, *, float_ops: str = "fallback",
          dump_dir: str | None = None) -> PipelineResult:
    """Import ``q`` for ``batch`` and run the default pass pipeline."""
    g = import_graph(q.module, example_batch(q, batch), name="model")
    return run_pipeline(g, default_pipeline(float_ops), dump_dir=dump_dir)


class ReferenceProgram:
    def __init__(self, q: QuantizedModel, *, float_ops: str = "fallback") -> None:
        self.q, self.float_ops = q, float_ops
        self._graphs: dict[int, PipelineResult] = {}
        self._lock = threading.Lock()

    def lowered(self, batch: int) -> PipelineResult:
        with self._lock:
            if batch not in self._graphs:
                self._graphs[batch] = lower(self.q, batch, float_ops=self.float_ops)
            return self._graphs[batch]

    def graph(self, batch: int) -> Graph:
        return self.lowered(batch).graph

    def __call__(self, *inputs: torch.Tensor) -> Any:
        g = self.graph(int(inputs[0].shape[0]))
        outs = interpreter.run(g, *[x.detach().numpy() for x in inputs])
        tensors = [torch.from_numpy(np.ascontiguousarray(o)) for o in outs]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def report(self, batch: int = 1) -> dict[str, Any]:
        lowered = self.lowered(batch)
        return {"passes": lowered.stats, "residency": residency(lowered.graph)}

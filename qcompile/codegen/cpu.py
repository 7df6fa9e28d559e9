"""Target ``cpu``: QIR after the pass pipeline → MLIR → IREE llvm-cpu, one module per compiled
batch size.

QIR is static-shaped, so each batch size in ``batch_sizes`` gets its own module (1 is always
among them). A call with another batch size runs in pieces of compiled sizes, largest first, and
the pieces' outputs are concatenated: any batch from 1 to ``max_batch`` runs, and results do not
depend on how a batch is split (each sample is computed on its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qcompile.codegen import iree_cpu
from qcompile.codegen.mlir_emit import EmitOptions, emit_module
from qcompile.ir.graph import Graph
from qcompile.ir.types import DType


@dataclass
class BatchModule:
    batch: int
    vmfb: bytes
    flags: tuple[str, ...]
    workaround: str | None
    graph: Graph | None = None        # None when loaded from an artifact
    mlir: str | None = None
    driver: str = "local-task"        # IREE runtime driver (hip, vulkan for the GPU targets)
    _module: iree_cpu.Module | None = field(default=None, repr=False)

    def module(self) -> iree_cpu.Module:
        if self._module is None:
            self._module = iree_cpu.Module(self.vmfb, self.driver)
        return self._module


def compile_graph(graph: Graph, batch: int, *, keep_dir: str | Path | None = None
                  ) -> BatchModule:
    """Emit and compile ``graph``; on failure walk the workaround ladder:

    1. fast flags (data tiling + inner-tiled VNNI path);
    2. the same with dequantize epilogues in their own dispatch: IREE 3.13 turns a per-channel
       table read back into a broadcast operand when the rest of the epilogue folds away (a zero
       bias) and then crashes materializing the encoding;
    3. the flag sets of :data:`iree_cpu.WORKAROUNDS`: no inner-tiled path (contractions then
       emitted s8 × s8 for IREE's mmt4d ukernels, several times slower than the u8 path but far
       faster than untiled code), then no data tiling.
    """
    ladder = [(None, iree_cpu.FAST_FLAGS, EmitOptions()),
              ("split-dequant-epilogues", iree_cpu.FAST_FLAGS, EmitOptions(split_dequant=True)),
              *((name, flags, EmitOptions(s8_contractions=name == "no-inner-tiled"))
                for name, flags in iree_cpu.WORKAROUNDS)]
    texts: dict[EmitOptions, str] = {}
    errors: list[str] = []
    for workaround, extra, opts in ladder:
        if opts not in texts:
            texts[opts] = emit_module(graph, opts).operation.get_asm(enable_debug_info=True)
        flags = (*iree_cpu.TARGET_FLAGS, *extra)
        got = iree_cpu.try_compile(texts[opts], flags)
        if isinstance(got, bytes):
            return BatchModule(batch, got, flags, workaround, graph, texts[opts])
        errors.append(got)
    raise iree_cpu.failure(texts[EmitOptions()], (*iree_cpu.TARGET_FLAGS, *iree_cpu.FAST_FLAGS),
                           errors, keep_dir, f"{graph.name}.b{batch}")


def pieces(n: int, sizes: Sequence[int]) -> list[int]:
    """Split ``n`` into compiled batch sizes, largest first (``1`` must be compiled)."""
    out: list[int] = []
    for s in sorted(sizes, reverse=True):
        while n >= s:
            out.append(s)
            n -= s
    if n:
        raise ValueError(f"batch remainder {n} fits no compiled size {sorted(sizes)}")
    return out


def run_in_pieces(call: Callable[[int, list[np.ndarray]], list[np.ndarray]],
                  inputs: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    """Run ``call(size, piece_inputs)`` over the pieces of the batch; outputs concatenated."""
    n = int(inputs[0].shape[0])
    if n in sizes:
        return call(n, list(inputs))
    results: list[list[np.ndarray]] = []
    start = 0
    for size in pieces(n, sizes):
        results.append(call(size, [x[start:start + size] for x in inputs]))
        start += size
    return [np.concatenate(parts) for parts in zip(*results, strict=True)]


@dataclass
class OutputSpec:
    dtype: str                       # QIR dtype name of the graph output
    shape: tuple[int, ...]           # without the batch dimension

    def to_torch(self, raw: np.ndarray) -> torch.Tensor:
        if self.dtype == DType.U8.value:
            raw = raw.view(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(raw))


class CpuRunner:
    """Torch tensors in → pieces through the per-batch IREE modules → torch tensors out."""

    def __init__(self, modules: dict[int, BatchModule], outputs: list[OutputSpec]) -> None:
        self.modules, self.outputs = modules, outputs

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        return run_in_pieces(lambda size, xs: self.modules[size].module()(*xs), inputs,
                             list(self.modules))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        raw = self.run_numpy(*[x.detach().contiguous().numpy() for x in inputs])
        outs = [spec.to_torch(r) for spec, r in zip(self.outputs, raw, strict=True)]
        return outs[0] if len(outs) == 1 else tuple(outs)


def build(graphs: dict[int, Graph], *, keep_dir: str | Path | None = None
          ) -> tuple[CpuRunner, dict[str, Any]]:
    """Compile one module per batch size; returns the runner and a compile report."""
    modules: dict[int, BatchModule] = {}
    times: dict[str, float] = {}
    for batch, graph in sorted(graphs.items()):
        t0 = time.perf_counter()
        modules[batch] = compile_graph(graph, batch, keep_dir=keep_dir)
        times[str(batch)] = round(time.perf_counter() - t0, 3)
    first = graphs[min(graphs)]
    outputs = [OutputSpec(o.dtype.value, tuple(o.shape[1:])) for o in first.outputs]
    report = {"batch_sizes": sorted(modules), "compile_s_per_batch": times,
              "workarounds": {str(b): m.workaround for b, m in modules.items() if m.workaround},
              "flags": list(modules[min(modules)].flags)}
    return CpuRunner(modules, outputs), report

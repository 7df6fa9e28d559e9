"""Target ``cuda``: QIR after the pass pipeline → Triton kernels on an NVIDIA GPU (sm_80+).

One :class:`~qcompile.codegen.triton.program.Program` is built per compiled batch size (QIR is
static-shaped); other batch sizes run in pieces, as on target ``cpu``. Kernels are JIT-compiled
by Triton for the GPU at their first launch, which :func:`compile_cuda` makes once per batch
size on zeros: a Triton failure is then a ``CompileError`` of the target, reported like an IREE
failure, with its reproducer in ``compile.keep_dir`` (else the run's output folder, else the
current folder; :mod:`qcompile.codegen.triton.repro`).

Without a GPU the target is unavailable, with the reason. The same kernels run in Triton's CPU
interpreter when ``TRITON_INTERPRET=1`` is set (or with ``interpret=True``): slow, meant for the
bit-exactness tests, which compare every chain with the reference interpreter.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qcompile.codegen.triton import loader
from qcompile.codegen.triton.lower import lower_graph
from qcompile.codegen.triton.program import TORCH_DTYPE, Program
from qcompile.frontend.quantize import QuantizedModel
from qcompile.ir.graph import Graph
from qcompile.passes.residency import residency
from qcompile.runtime.compiled import CompiledModel

MIN_CAPABILITY = (8, 0)
INTERPRET_HINT = ("to run the same kernels in Triton's CPU interpreter (slow; for checking), "
                  "set TRITON_INTERPRET=1")


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def unavailable_reason(interpret: bool | None = None) -> str | None:
    """``None`` when target ``cuda`` can run here, else why not (no traceback, no import of
    anything heavy beyond torch)."""
    interpret = interpret_requested() if interpret is None else interpret
    missing = loader.triton_missing()
    if missing or interpret:
        return missing
    if torch.version.cuda is None:
        return (f"this torch build ({torch.__version__}) has no CUDA support, so no NVIDIA GPU "
                f"can be used; {INTERPRET_HINT}")
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible (torch.cuda.is_available() is False); {INTERPRET_HINT}"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return (f"GPU {torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}; the int8 "
                f"tensor-core kernels need sm_80 or newer")
    return None


@dataclass(frozen=True)
class CudaOptions:
    """Options of the ``cuda`` target beyond the shared ``CompileOptions`` (batch sizes, float
    ops policy): ``interpret`` runs the kernels in Triton's interpreter on the CPU; ``conv``
    forces a convolution algorithm (``auto``, ``igemm``, ``direct``)."""

    interpret: bool = False
    conv: str = "auto"


class CudaRunner:
    """Torch tensors in → pieces through the per-batch programs → CPU torch tensors out.
    ``graphs``: the QIR each program was built from (what the reference interpreter runs)."""

    def __init__(self, programs: dict[int, Program], graphs: dict[int, Graph]) -> None:
        self.programs, self.graphs = programs, graphs

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        from qcompile.codegen.cpu import run_in_pieces

        return run_in_pieces(lambda size, xs: self.programs[size].run_numpy(*xs), inputs,
                             list(self.programs))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        raw = self.run_numpy(*[x.detach().contiguous().numpy() for x in inputs])
        outs = [torch.from_numpy(r) for r in raw]
        return outs[0] if len(outs) == 1 else tuple(outs)


def device_info(interpret: bool) -> dict[str, Any]:
    if interpret:
        return {"device": "cpu", "mode": "triton-interpreter"}
    cap = torch.cuda.get_device_capability()
    return {"device": torch.cuda.get_device_name(), "mode": "compiled",
            "capability": f"sm_{cap[0]}{cap[1]}"}


def _arch() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def first_launches(programs: dict[int, Program], graphs: dict[int, Graph]) -> None:
    """Every program run once on zero inputs: Triton JIT-compiles each kernel at its first
    launch, so compile faults surface here (as ``CompileError``) and not in the first call."""
    from qcompile.codegen.triton import repro

    with repro.quiet():     # a ptxas failure prints the whole PTX (not one screen)
        for b, program in programs.items():
            program.run_device([torch.zeros(n.shape, dtype=TORCH_DTYPE[n.dtype],
                                            device=program.device) for n in graphs[b].inputs])
        torch.cuda.synchronize()


def compile_cuda(q: QuantizedModel, options: Any = None, cuda: CudaOptions | None = None
                 ) -> CompiledModel:
    """Build the ``cuda`` target for ``q``. ``options``: the shared
    :class:`qcompile.codegen.target.CompileOptions` (``batch_sizes``, ``float_ops``)."""
    from qcompile.codegen.target import CompileOptions, batch_sizes
    from qcompile.errors import TargetUnavailableError
    from qcompile.reference.program import lower
    from qcompile.targets import signature_of

    options = options or CompileOptions()
    cuda = cuda or CudaOptions(interpret=interpret_requested())
    reason = unavailable_reason(cuda.interpret)
    if reason is not None:
        raise TargetUnavailableError("target 'cuda' is not available", at="target cuda",
                                     why=reason, next="use target 'reference' or 'cpu' here")
    device = torch.device("cpu" if cuda.interpret else "cuda")
    module = loader.kernels(cuda.interpret)
    t0 = time.perf_counter()
    lowered = {b: lower(q, b, float_ops=options.float_ops)
               for b in batch_sizes(q, tuple(options.batch_sizes))}
    programs = {b: lower_graph(r.graph, module, device, cuda.conv) for b, r in lowered.items()}
    arch = None if cuda.interpret else _arch()
    for program in programs.values():
        program.keep_dir, program.arch = options.keep_dir, arch
    lower_s = time.perf_counter() - t0
    if not cuda.interpret:      # the interpreter compiles nothing; a failure there is raised
        first_launches(programs, {b: r.graph for b, r in lowered.items()})   # by the call
    first = lowered[min(lowered)]
    report = {"passes": first.stats, "residency": residency(first.graph),
              "kernels": programs[max(programs)].summary(), **device_info(cuda.interpret),
              "compile": {"batch_sizes": sorted(programs), "lower_s": round(lower_s, 3),
                          "jit_s": round(time.perf_counter() - t0 - lower_s, 3)}}
    graphs = {b: r.graph for b, r in lowered.items()}
    return CompiledModel("cuda", signature_of(q), CudaRunner(programs, graphs), report)

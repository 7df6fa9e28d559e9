"""A compiled ``cuda`` program: the steps of one static-shaped QIR graph, run in order.

A :class:`Step` produces the value of one QIR node (the last node of a fused chain) by a Triton
kernel launch (:class:`Launch`), a torch op on the device (data movement: reshape, permute, cat,
pad) or, for ops with no GPU lowering (float fallbacks), the reference interpreter on the host.
Launch arguments are device tensors built once (weights, epilogue tables), ints, or
:class:`Ref` placeholders for run-time values, so the same description serves the launch, the
ahead-of-time compile (:mod:`qcompile.codegen.triton.aot`) and the report.

A kernel is JIT-compiled by Triton at its first launch: any exception out of that launch (or out
of any launch in the interpreter) becomes a :class:`~qcompile.errors.CompileError` that names the
kernel, the chain and its source location and leaves a reproducer in ``keep_dir``
(:mod:`qcompile.codegen.triton.repro`). A kernel that failed after it once ran is not a compile
fault and raises as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from qcompile.codegen.triton import loader
from qcompile.ir.types import DType

TORCH_DTYPE = {DType.F32: torch.float32, DType.I8: torch.int8, DType.U8: torch.uint8,
               DType.I32: torch.int32, DType.I64: torch.int64, DType.BOOL: torch.bool}


@dataclass(frozen=True)
class Ref:
    """The run-time value of QIR node ``key`` (``dtype``), optionally broadcast to ``expand``
    and then reshaped to ``view`` (contiguous)."""

    key: int
    dtype: torch.dtype
    expand: tuple[int, ...] | None = None
    view: tuple[int, ...] | None = None

    def resolve(self, env: dict[int, torch.Tensor]) -> torch.Tensor:
        t = env[self.key]
        if self.expand is not None and tuple(t.shape) != self.expand:
            t = t.expand(self.expand)
        if self.view is not None:
            t = t.reshape(self.view)
        return t.contiguous()


class _Out:
    """The step's own output tensor (also passed for pointer arguments a kernel ignores)."""

    def __repr__(self) -> str:
        return "OUT"


OUT = _Out()


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernels.<kernel>[grid](*args, **consts)``."""

    kernel: str
    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    consts: dict[str, int]
    warps: int = 4
    stages: int = 2
    tile: str = ""

    def run(self, module: ModuleType, env: dict[int, torch.Tensor], out: torch.Tensor) -> None:
        args = [out if a is OUT else a.resolve(env) if isinstance(a, Ref) else a
                for a in self.args]
        getattr(module, self.kernel)[self.grid](*args, **self.consts, num_warps=self.warps,
                                                num_stages=self.stages, enable_fp_fusion=False)


@dataclass
class Step:
    """Computes QIR node ``key`` (``nodes``: every QIR node the step covers, e.g. a conv and
    its requantize). ``kind``: ``kernel``, ``torch`` (device data movement) or ``host``."""

    key: int
    nodes: tuple[int, ...]
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    label: str
    launch: Launch | None = None
    fn: Callable[..., torch.Tensor] | None = None
    inputs: tuple[Ref, ...] = ()
    reason: str | None = None          # why a host step is not on the device
    loc: str | None = None             # source location of the chain (its anchor's)

    def run(self, module: ModuleType, env: dict[int, torch.Tensor], device: torch.device,
            guard: Callable[[Step], Any] | None = None) -> torch.Tensor:
        """The step's value; ``guard(step)``: a context manager around the kernel launch."""
        if self.launch is not None:
            out = torch.empty(self.shape, dtype=self.dtype, device=device)
            with guard(self) if guard is not None else nullcontext():
                self.launch.run(module, env, out)
            return out
        assert self.fn is not None
        return self.fn(*[r.resolve(env) for r in self.inputs])


@dataclass
class Program:
    """The steps of one graph for one batch size, on ``device`` (``cpu`` when interpreted).
    ``keep_dir``: where a failed kernel leaves its reproducer (``None``: the current folder);
    ``arch``: the GPU's ``sm_<arch>`` that reproducer compiles for (``None``: 80)."""

    module: ModuleType
    device: torch.device
    inputs: tuple[int, ...]                       # node keys of the graph inputs
    outputs: tuple[int, ...]
    constants: dict[int, torch.Tensor]            # CONST nodes read at run time
    steps: list[Step] = field(default_factory=list)
    keep_dir: str | None = None
    arch: int | None = None
    launched: set[int] = field(default_factory=set, repr=False)   # steps that launched once

    def run_device(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors in, device tensors out (no host copies except host steps)."""
        env: dict[int, torch.Tensor] = dict(self.constants)
        for key, x in zip(self.inputs, inputs, strict=True):
            env[key] = x
        interpreted = loader.is_interpreted(self.module)
        for step in self.steps:
            guarded = interpreted or step.key not in self.launched   # no cost once compiled
            env[step.key] = step.run(self.module, env, self.device,
                                     self._guard if guarded else None)
        return [env[k] for k in self.outputs]

    @contextmanager
    def _guard(self, step: Step) -> Iterator[None]:
        """A failed first launch (Triton compiles then) or a failed interpreted launch becomes a
        ``CompileError`` with its reproducer saved."""
        interpreted = loader.is_interpreted(self.module)
        try:
            yield
        except Exception as err:
            if step.key in self.launched and not interpreted:
                raise           # it ran before: not a compile fault
            from qcompile.codegen.triton import aot

            raise aot.launch_failure(step, err, self.keep_dir, self.arch, interpreted) from err
        self.launched.add(step.key)

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        xs = [torch.from_numpy(np.ascontiguousarray(x)).to(self.device) for x in inputs]
        return [o.cpu().numpy() for o in self.run_device(xs)]

    def launches(self) -> list[Step]:
        return [s for s in self.steps if s.launch is not None]

    def summary(self) -> dict[str, Any]:
        """Kernel counts, host fallbacks and the tile of every launch (for the report). A fused
        chain is one step and a step launches at most one kernel, so ``max_per_chain`` is 1
        whenever there are chains; chains that did not fuse show up as separate steps."""
        chains = [s for s in self.steps if s.kind == "kernel" and len(s.nodes) > 1]
        return {
            "total": len(self.launches()),
            "steps": len(self.steps),
            "fused_chains": len(chains),
            "max_per_chain": 1 if chains else 0,
            "by_kernel": _count(s.launch.kernel for s in self.launches() if s.launch),
            "torch_ops": _count(s.label for s in self.steps if s.kind == "torch"),
            "host_ops": [{"op": s.label, "reason": s.reason} for s in self.steps
                         if s.kind == "host"],
            "launches": [{"op": s.label, "kernel": s.launch.kernel, "grid": list(s.launch.grid),
                          "tile": s.launch.tile} for s in self.launches() if s.launch],
        }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return dict(sorted(out.items()))


def host_tensor(value: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(value)).to(device)

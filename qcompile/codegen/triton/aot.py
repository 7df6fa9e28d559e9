"""Ahead-of-time compilation of ``cuda`` launches for a GPU architecture, without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cap, 32))`` runs
Triton's whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin with the bundled ``ptxas``) on the
CPU. The signature and constants come from the same :class:`~.program.Launch` the runtime
launches, and :func:`launch_attrs` adds the specialisation Triton's launcher adds (16-byte
divisibility of pointers and of ints that are multiples of 16), so what is compiled here is what
a GPU would JIT-compile: without it, int8 loads cannot be vectorised or made asynchronous
(``cp.async``) and the PTX would show a slower kernel than the one that runs.

:func:`tensor_core_ops` counts the integer MMA instructions in the PTX: ``mma.sync`` with
``.s8`` operands (sm_80 and up) and ``wgmma.mma_async`` with ``.s8`` (sm_90 warp-group MMA).

Every compile goes through :func:`launch_spec` and :func:`.repro.compile_spec`, so a failure
saves exactly the ``triton.compile`` that failed (:func:`launch_failure` does the same for a
launch that failed at run time) and the ``CompileError`` prints the command that reruns it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from qcompile.codegen.triton import loader, repro
from qcompile.codegen.triton.program import OUT, Launch, Ref, Step
from qcompile.errors import CompileError

_PTR = {torch.int8: "*i8", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64",
        torch.float32: "*fp32", torch.float16: "*fp16", torch.bool: "*i1"}
_MMA = re.compile(r"\b(mma\.sync\.aligned\.[\w.]+|wgmma\.mma_async\.[\w.]+)")


@dataclass(frozen=True)
class Compiled:
    """One launch compiled for ``sm_<arch>``: its PTX and the tensor-core instructions in it."""

    kernel: str
    arch: int
    ptx: str
    mma: dict[str, int]

    @property
    def int8_mma(self) -> bool:
        return any(".s8" in op for op in self.mma)

    @property
    def wgmma_s8(self) -> bool:
        return any(op.startswith("wgmma") and ".s8" in op for op in self.mma)

    @property
    def mma_sync_s8(self) -> bool:
        return any(op.startswith("mma.sync") and ".s8" in op for op in self.mma)


def arg_type(arg: Any, out_dtype: torch.dtype) -> str:
    if arg is OUT:
        return _PTR[out_dtype]
    if isinstance(arg, Ref):
        return _PTR[arg.dtype]
    if isinstance(arg, torch.Tensor):
        return _PTR[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    raise TypeError(f"no Triton type for launch argument {arg!r}")


def signature(launch: Launch, out_dtype: torch.dtype) -> tuple[dict[str, str], dict[str, Any]]:
    """``(signature, constexprs)`` of ``launch`` for ``ASTSource``, in the kernel's order."""
    fn = getattr(loader.kernels(False), launch.kernel)
    names = list(fn.arg_names)
    runtime = names[:len(launch.args)]
    sig = {n: arg_type(a, out_dtype) for n, a in zip(runtime, launch.args, strict=True)}
    missing = [n for n in names[len(launch.args):] if n not in launch.consts]
    if missing:
        raise ValueError(f"{launch.kernel}: constexprs {missing} are not set")
    sig.update({n: "constexpr" for n in names[len(launch.args):]})
    return sig, dict(launch.consts)


def launch_attrs(launch: Launch) -> dict[tuple[int, ...], list[list[Any]]]:
    """``tt.divisibility = 16`` where the launcher would put it: every tensor argument (torch
    allocations and the contiguous operands of a step are 16-byte aligned) and every int
    argument that is a multiple of 16."""
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, a in enumerate(launch.args):
        is_int = isinstance(a, int) and not isinstance(a, bool)
        if a is OUT or isinstance(a, Ref | torch.Tensor) or (is_int and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def launch_spec(launch: Launch, out_dtype: torch.dtype, arch: int, *, label: str | None = None,
                loc: str | None = None) -> dict[str, Any]:
    """What ``triton.compile`` gets for ``launch`` on ``sm_<arch>``, as JSON-able data (the
    fields of a reproducer, :mod:`qcompile.codegen.triton.repro`)."""
    sig, consts = signature(launch, out_dtype)
    return {"kernel": launch.kernel, "step": label, "loc": loc, "signature": sig,
            "constexprs": {k: _plain(v) for k, v in consts.items()},
            "attrs": [[list(k), v] for k, v in launch_attrs(launch).items()],
            "num_warps": launch.warps, "num_stages": launch.stages,
            "options": {"enable_fp_fusion": False},
            "target": {"backend": "cuda", "arch": arch, "warp_size": 32},
            "grid": list(launch.grid), "tile": launch.tile}


def _plain(v: Any) -> Any:
    return v if isinstance(v, bool | int | float) else v.item()   # numpy scalars


def compile_launch(launch: Launch, out_dtype: torch.dtype, arch: int, *,
                   keep_dir: str | None = None, label: str | None = None,
                   loc: str | None = None) -> Compiled:
    """AOT-compile ``launch`` for ``sm_<arch>`` (80, 90, ...). A Triton failure is a
    ``CompileError`` with its reproducer saved in ``keep_dir`` (default: the current folder)."""
    spec = launch_spec(launch, out_dtype, arch, label=label, loc=loc)
    fn = getattr(loader.kernels(False), launch.kernel)
    failed: Exception | None = None
    with repro.quiet() as printed:          # ptxas failures print the whole PTX to stdout
        try:
            k = repro.compile_spec(spec, fn)
        except Exception as err:  # noqa: BLE001 - whatever Triton raises is a compile fault
            failed = err
    if failed is not None:
        raise repro.failure(spec, failed, keep_dir, "compile",
                            printed.getvalue()) from failed
    ptx = k.asm["ptx"]
    return Compiled(launch.kernel, arch, ptx, tensor_core_ops(ptx))


def compile_step(step: Step, arch: int, keep_dir: str | None = None) -> Compiled:
    assert step.launch is not None, f"step {step.label} launches no kernel"
    return compile_launch(step.launch, step.dtype, arch, keep_dir=keep_dir, label=step.label,
                          loc=step.loc)


def launch_failure(step: Step, err: Exception, keep_dir: str | None, arch: int | None,
                   interpreted: bool) -> CompileError:
    """The error of a kernel launch that failed at run time (the first one on a GPU, where
    Triton compiles it, or any in the interpreter), its reproducer saved."""
    assert step.launch is not None
    try:
        spec = launch_spec(step.launch, step.dtype, arch or 80, label=step.label, loc=step.loc)
    except (TypeError, ValueError) as why:      # not a launch Triton can be asked to compile
        return CompileError(f"kernel '{step.launch.kernel}' failed (chain {step.label})",
                            at=step.loc, why=f"{repro.error_text(err)}\n(no reproducer: {why})")
    return repro.failure(spec, err, keep_dir, "interpreter" if interpreted else "launch")


def tensor_core_ops(ptx: str) -> dict[str, int]:
    """Counts of the ``mma.sync`` / ``wgmma.mma_async`` instruction forms in ``ptx``."""
    return dict(sorted(Counter(_MMA.findall(ptx)).items()))

"""Targets: where a quantized model runs. Each target turns a ``QuantizedModel`` into a
``CompiledModel``; a target that cannot run here says why (``unavailable_reason``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qcompile.errors import TargetUnavailableError
from qcompile.frontend.quantize import QuantizedModel
from qcompile.recipe import TARGETS
from qcompile.runtime.compiled import CompiledModel, InputSignature

Builder = Callable[[QuantizedModel, Any], CompiledModel]
_BUILDERS: dict[str, Builder] = {}
_PROBES: dict[str, Callable[[], str | None]] = {}   # built targets that may not run here


def register(name: str, probe: Callable[[], str | None] | None = None
             ) -> Callable[[Builder], Builder]:
    """Register ``name``'s builder; ``probe`` says why the target cannot run here (or None)."""
    def add(builder: Builder) -> Builder:
        _BUILDERS[name] = builder
        if probe is not None:
            _PROBES[name] = probe
        return builder

    return add


def signature_of(q: QuantizedModel, names: tuple[str, ...] = ()) -> tuple[InputSignature, ...]:
    """The inputs ``q`` takes at its example's sequence length (several lengths: see
    :func:`qcompile.targets.seq_lens.signature`)."""
    return tuple(
        InputSignature(names[i] if i < len(names) else f"input_{i}", x.dtype, tuple(x.shape[1:]),
                       None if q.dynamic_batch else x.shape[0], q.config.max_batch)
        for i, x in enumerate(q.example_inputs))


@register("pt2e")
def _pt2e(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """PT2E's own Q/DQ module: int8 simulated in float. The baseline every target is checked
    against. A module exported with a dynamic sequence length runs every length natively."""
    from qcompile.targets.seq_lens import signature

    sig = signature_of(q)
    return CompiledModel("pt2e", signature(q, sig) if len(q.seq_lens) > 1 else sig, q.module)


@register("reference")
def _reference(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR after the pass pipeline, executed exactly by the numpy reference interpreter."""
    from qcompile.reference.program import ReferenceProgram

    program = ReferenceProgram(q)
    return CompiledModel("reference", signature_of(q), program, program.report())


@register("cpu")
def _cpu(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR → MLIR → IREE llvm-cpu for this host, one module per compiled batch size."""
    from qcompile.codegen.target import compile_cpu

    return compile_cpu(q, options)


@register("ort")
def _ort(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR → an integer ONNX model (ConvInteger/MatMulInteger, int64 requantize) → ONNX Runtime
    on the CPU, one model per compiled batch size; checked against the reference."""
    from qcompile.codegen.ort.target import compile_ort

    return compile_ort(q, options)


def _cuda_probe() -> str | None:
    from qcompile.codegen.triton.target import unavailable_reason

    return unavailable_reason()


@register("cuda", probe=_cuda_probe)
def _cuda(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR → Triton kernels (int8 tensor cores) on an NVIDIA GPU, sm_80 or newer. With
    ``TRITON_INTERPRET=1`` the same kernels run in Triton's CPU interpreter (for checking)."""
    from qcompile.codegen.triton.target import compile_cuda

    return compile_cuda(q, options)


def _gpu_probe(device: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        from qcompile.codegen.iree_gpu import device_present

        why = device_present(device)
        return None if why is None else (
            f"{why}; the artifacts still compile here (qcompile.codegen.iree_gpu.compile_gpu, "
            f"checked in CI for int8 instructions)")
    return probe


@register("rocm", probe=_gpu_probe("rocm"))
def _rocm(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR → MLIR → IREE HIP for AMD GPUs (gfx942: int8 MFMA)."""
    from qcompile.codegen.iree_gpu import compile_gpu_target

    return compile_gpu_target(q, "rocm", options)


@register("vulkan", probe=_gpu_probe("vulkan"))
def _vulkan(q: QuantizedModel, options: Any = None) -> CompiledModel:
    """QIR → MLIR → IREE Vulkan SPIR-V (integer dot product)."""
    from qcompile.codegen.iree_gpu import compile_gpu_target

    return compile_gpu_target(q, "vulkan", options)


_PLANNED: dict[str, str] = {}


def unavailable_reason(target: str) -> str | None:
    """``None`` when ``target`` can run here, else why not."""
    if target in _BUILDERS:
        probe = _PROBES.get(target)
        return probe() if probe else None
    return _PLANNED.get(target, f"unknown target; valid targets: {', '.join(TARGETS)}")


def compile_quantized(q: QuantizedModel, target: str, options: Any = None) -> CompiledModel:
    reason = unavailable_reason(target)
    if reason is not None:
        raise TargetUnavailableError(
            f"target {target!r} is not available", at=f"target {target}", why=reason,
            next="use one of the available targets: "
                 f"{', '.join(t for t in sorted(_BUILDERS) if unavailable_reason(t) is None)}")
    if len(q.seq_lens) > 1 and target != "pt2e":
        from qcompile.targets.seq_lens import compile_seq_lens

        return compile_seq_lens(q, target, _BUILDERS[target], options)
    model = _BUILDERS[target](q, options)
    if q.seq_lens:          # one length (asked for, or the export kept it static): say so
        from qcompile.targets.seq_lens import seq_report

        model.report["seq_lens"] = seq_report(q, list(q.seq_lens))
        if isinstance(model.report.get("compile"), dict):
            model.report["compile"]["seq_lens"] = list(q.seq_lens)
    return model

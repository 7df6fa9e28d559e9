"""Targets ``rocm`` and ``vulkan``: the same MLIR as target ``cpu`` (see
:mod:`qcompile.codegen.mlir_emit`), compiled by IREE for AMD GPUs (HIP, int8 MFMA) and Vulkan
(SPIR-V, integer dot product / cooperative matrix), and the device code inspected for the int8
instructions it really uses.

Compiling needs no GPU, so CI builds these artifacts; running needs the device, and a target
whose IREE driver finds no device here is reported unavailable with that reason.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qcompile.codegen import iree_cpu
from qcompile.codegen.mlir_emit import EmitOptions, emit_module
from qcompile.errors import CompileError
from qcompile.ir.graph import Graph


@dataclass(frozen=True)
class Device:
    driver: str                          # IREE runtime driver
    flags: tuple[str, ...]
    arch_flag: str
    default_arch: str
    # (name, extra flags) tried in order when the default configuration fails
    workarounds: tuple[tuple[str, tuple[str, ...]], ...]
    # instruction class -> pattern in the dumped device code
    instructions: dict[str, str] = field(default_factory=dict)
    code_suffixes: tuple[str, ...] = ()


DEVICES = {
    "rocm": Device(
        "hip", ("--iree-hal-target-device=hip",), "--iree-rocm-target", "gfx942",
        # IREE 3.13's tile-and-fuse matmul config overflows the 64 KiB LDS on some int8 GEMMs
        # (resnet18's 196x256x2304); its vector-distribution config does not
        (("no-tile-and-fuse-matmul", ("--iree-codegen-llvmgpu-use-tile-and-fuse-matmul=false",)),),
        {"int8_mfma": r"v_mfma_i32_\w*i8", "int8_wmma": r"v_wmma_i32_\w*iu8",
         "int8_dot": r"v_dot4c?_i32_[iu]8"}, (".rocmasm",)),
    "vulkan": Device(
        "vulkan", ("--iree-hal-target-device=vulkan",), "--iree-vulkan-target", "ampere", (),
        {"int8_dot": r"spirv\.(?:S|SU|U)Dot(?:AccSat)?\b",
         "int8_coop_matrix": r"spirv\.KHR\.CooperativeMatrixMulAdd"}, (".spirv.mlir",)),
}


@dataclass
class GpuBuild:
    device: str
    arch: str
    vmfb: bytes
    flags: tuple[str, ...]
    workaround: str | None
    instructions: dict[str, int]

    def report(self) -> dict[str, Any]:
        return {"device": self.device, "arch": self.arch, "bytes": len(self.vmfb),
                "workaround": self.workaround, "instructions": self.instructions,
                "int8_instructions": sum(self.instructions.values())}


def compile_gpu(graph: Graph, device: str, arch: str | None = None, *,
                keep_dir: str | Path | None = None) -> GpuBuild:
    """Compile ``graph`` for ``device`` ('rocm' or 'vulkan') and count its int8 instructions."""
    if device not in DEVICES:
        raise ValueError(f"unknown GPU device {device!r}; valid: {', '.join(DEVICES)}")
    d = DEVICES[device]
    arch = arch or d.default_arch
    module = emit_module(graph, EmitOptions(cpu_strategies=False))
    mlir = module.operation.get_asm(enable_debug_info=True)
    base = (*d.flags, f"{d.arch_flag}={arch}")
    errors: list[str] = []
    for workaround, extra in ((None, ()), *d.workarounds):
        with tempfile.TemporaryDirectory(prefix="qcompile-gpu-") as tmp:
            flags = (*base, *extra)
            got = iree_cpu.try_compile(mlir, (*flags,
                                              f"--iree-hal-dump-executable-intermediates-to={tmp}"))
            if isinstance(got, bytes):
                code = "".join(p.read_text(errors="replace") for p in sorted(Path(tmp).iterdir())
                               if p.name.endswith(d.code_suffixes))
                found = {k: len(re.findall(pat, code)) for k, pat in d.instructions.items()}
                return GpuBuild(device, arch, got, flags, workaround, found)
            errors.append(got)
    err = iree_cpu.failure(mlir, base, errors, keep_dir, f"{graph.name}.{device}-{arch}")
    raise CompileError(f"iree-compile failed for target {device} ({arch})", at=err.at,
                       why=err.why, next=err.next)


def device_present(device: str) -> str | None:
    """``None`` when IREE's driver for ``device`` finds a device here, else why not."""
    import iree.runtime as rt

    driver = DEVICES[device].driver
    try:
        found = rt.get_driver(driver).query_available_devices()
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).splitlines()[0].split("; ")[-1][:160]
        return f"IREE's {driver} driver cannot start here ({first})"
    if not found:
        return f"IREE's {driver} driver finds no device on this machine"
    return None


def compile_gpu_target(q: Any, device: str, options: Any = None) -> Any:
    """A :class:`CompiledModel` running on ``device`` through IREE (needs the device)."""
    from qcompile.codegen.cpu import BatchModule, CpuRunner, OutputSpec
    from qcompile.codegen.target import CompileOptions, batch_sizes, signature
    from qcompile.reference.program import lower
    from qcompile.runtime.compiled import CompiledModel

    options = options or CompileOptions()
    modules, builds = {}, {}
    for b in batch_sizes(q, options.batch_sizes):
        graph = lower(q, b, float_ops=options.float_ops).graph
        build = compile_gpu(graph, device, keep_dir=options.keep_dir)
        modules[b] = BatchModule(b, build.vmfb, build.flags, build.workaround, graph,
                                 driver=DEVICES[device].driver)
        builds[str(b)] = build.report()
    first = modules[min(modules)].graph
    outputs = [OutputSpec(o.dtype.value, tuple(o.shape[1:])) for o in first.outputs]
    return CompiledModel(device, signature(q), CpuRunner(modules, outputs),
                         {"compile": {"batch_sizes": sorted(modules), "builds": builds}})

"""Targets rocm and vulkan: the cpu target's MLIR compiled by IREE for AMD (gfx942) and Vulkan
(SPIR-V), no device needed; the device code must hold int8 instructions (MFMA on gfx942, integer
dot products on Vulkan). What was found is printed (`pytest -s`) and asserted."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from qcompile.codegen.iree_gpu import compile_gpu
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.pipeline import build_model, calibration_batches
from qcompile.recipe import load_recipe
from qcompile.reference.program import lower
from qcompile.targets import compile_quantized, unavailable_reason

RECIPES = Path(__file__).parent.parent / "recipes"
EXPECT = {"rocm": "int8_mfma", "vulkan": "int8_dot"}


def _graph(name: str):
    r = load_recipe(RECIPES / f"{name}.yaml")
    mut = build_model(r)
    q = quantize(mut.module, mut.example_inputs(), itertools.islice(calibration_batches(r, mut), 2),
                 QuantizeConfig.from_recipe(r))
    return q, lower(q, 1).graph


def _check(name: str, device: str) -> None:
    _, graph = _graph(name)
    build = compile_gpu(graph, device)
    print(f"{name} {device} {build.arch}: {build.report()}")
    assert build.vmfb[:8]
    assert build.instructions[EXPECT[device]] > 0, build.instructions


@pytest.mark.parametrize("device", ["rocm", "vulkan"])
def test_digits_cnn__compiles_with_int8_instructions(device):
    _check("digits_cnn", device)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["rocm", "vulkan"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "bert_encoder"])
def test_zoo_model__compiles_with_int8_instructions(name, device):
    _check(name, device)


@pytest.mark.parametrize("device", ["rocm", "vulkan"])
def test_gpu_target_without_device__is_unavailable_with_the_reason(device):
    reason = unavailable_reason(device)
    if reason is None:
        pytest.skip(f"a {device} device is present here")   # then the target really runs
    assert "driver" in reason and "compile here" in reason
    from qcompile.errors import TargetUnavailableError

    with pytest.raises(TargetUnavailableError, match=f"target '{device}' is not available"):
        compile_quantized(None, device)  # type: ignore[arg-type]


def test_unknown_gpu_device_is_refused():
    with pytest.raises(ValueError, match="valid: rocm, vulkan"):
        compile_gpu(None, "metal")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["rocm", "vulkan"])
def test_attention_matmul__compiles_without_cpu_strategies(device):
    """The cpu target presets llvm-cpu tile strategies on attention's batch GEMM; the GPU
    pipelines reject those, so their module must come without them."""
    from qcompile.ir import qmath
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    a = node(Op.INPUT, DType.U8, (1, 2, 16, 32), name="a")
    k = node(Op.INPUT, DType.U8, (1, 2, 16, 32), name="k")
    kt = node(Op.PERMUTE, DType.U8, (1, 2, 32, 16), k, dims=(0, 1, 3, 2))
    mm = node(Op.QMATMUL, DType.I32, (1, 2, 16, 16), a, kt, a_zp=3, b_zp=128)
    out = QParams(DType.U8, (1.0,), (128,), 0, 255)
    q = node(Op.REQUANT, DType.U8, mm.shape, mm,
             rq=qmath.make_requant([[3e-4]], [0], out, axis=None))
    build = compile_gpu(Graph("attention_mm", (a, k), (q,)), device)
    assert build.vmfb[:8]
    assert build.workaround is None
    assert build.instructions[EXPECT[device]] > 0, build.instructions

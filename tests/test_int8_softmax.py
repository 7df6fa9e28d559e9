"""int8 attention pieces: softmax on int8 codes (QSOFTMAX) and arithmetic with a scalar constant
as a table (LUT). The integer softmax stays within one output step of PT2E's float softmax; every
target (reference, cpu, ort, the Triton kernels under the interpreter) computes the same codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qcompile.codegen.ort.target import build as build_ort
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir import qmath
from qcompile.ir.graph import Op
from qcompile.ir.parser import parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.types import DType, QParams
from qcompile.ir.verify import verify
from qcompile.passes.int8_softmax import Int8Softmax
from qcompile.passes.unary_to_lut import UnaryToLut
from qcompile.reference import interpreter
from qcompile.reference.program import lower

QX = "qp(u8, s=(0.125,), zp=(200,), range=(0, 255), axis=None)"
QP = "qp(u8, s=(0.00390625,), zp=(0,), range=(0, 255), axis=None)"


def _softmax_graph(qx: str = QX, qp: str = QP, extra: str = "", ret: str = "%o") -> str:
    return f"""graph @s {{
  %a = input() {{name='a'}} : u8[2,3,40]
  %da = dequant(%a) {{qp={qx}}} : f32[2,3,40]
  %p = softmax(%da) {{axis=-1}} : f32[2,3,40]
  %o = quant(%p) {{qp={qp}}} : u8[2,3,40]
{extra}  return {ret}
}}"""


def _pt2e_softmax(codes: np.ndarray, x: QParams, out: QParams, axis: int = -1) -> np.ndarray:
    real = torch.from_numpy(qmath.dequantize_array(codes, x))
    return qmath.quantize_array(torch.softmax(real, dim=axis).numpy(), out)


def _qp(dtype: DType, scale: float, zp: int) -> QParams:
    return QParams(dtype, (scale,), (zp,), *dtype.range)


@pytest.mark.parametrize("dtype,scale,zp", [(DType.U8, 0.125, 200), (DType.U8, 0.02, 128),
                                            (DType.I8, 0.3, 0), (DType.U8, 2.5, 0)])
def test_softmax_codes__within_one_step_of_pt2e_and_rows_sum_to_one(dtype, scale, zp):
    rng = np.random.default_rng(0)
    lo, hi = dtype.range
    x = rng.integers(lo, hi + 1, size=(64, 77)).astype(dtype.np)
    x[:8, 40:] = lo                                   # masked keys: the lowest code
    x[8:12] = hi                                      # a flat row
    xq, out = _qp(dtype, scale, zp), _qp(DType.U8, 1 / 255, 0)
    got = qmath.softmax_codes(x, 1, qmath.softmax_table(xq), qmath.softmax_multiplier(out), 0,
                              (0, 255))
    want = _pt2e_softmax(x, xq, out, axis=1).astype(np.int64)
    assert np.abs(got - want).max() <= 1
    assert (got == want).mean() > 0.99
    assert np.all(np.abs(got.sum(axis=1) / 255 - 1) < 0.2)


def test_int8_softmax_pass__rewrites_and_the_result_verifies():
    g, fired = Int8Softmax().run(parse_graph(_softmax_graph()))
    verify(g, stage="int8-softmax")
    text = print_graph(g)
    assert fired == 1 and "qsoftmax(%a) {axis=2, m=16777216, range=(0, 255)" in text
    assert "softmax(" not in text.replace("qsoftmax(", "")


@pytest.mark.parametrize("case", ["two-readers", "per-channel-input", "output-too-fine"])
def test_int8_softmax_pass__must_not_fire(case):
    if case == "two-readers":
        text = _softmax_graph(extra="  %f = relu(%p) : f32[2,3,40]\n", ret="%o, %f")
    elif case == "per-channel-input":
        text = _softmax_graph(qx="qp(u8, s=(0.1, 0.2, 0.3), zp=(0, 0, 0), range=(0, 255), "
                                 "axis=1)")
    else:
        text = _softmax_graph(qp="qp(u8, s=(1e-05,), zp=(0,), range=(0, 255), axis=None)")
    _, fired = Int8Softmax().run(parse_graph(text))
    assert fired == 0


@pytest.mark.parametrize("expr,fn", [("mul(%da, %c)", lambda v: v * 0.375),
                                     ("sub(%c, %da)", lambda v: 0.375 - v),
                                     ("div(%da, %c)", lambda v: v / 0.375)])
def test_scalar_arithmetic__becomes_an_exact_table(expr, fn):
    text = f"""graph @m {{
  %a = input() {{name='a'}} : u8[1,256]
  %da = dequant(%a) {{qp={QX}}} : f32[1,256]
  %c = const() {{value=array(f32, [], [0.375])}} : f32[]
  %y = {expr} : f32[1,256]
  %o = quant(%y) {{qp=qp(u8, s=(0.05,), zp=(100,), range=(0, 255), axis=None)}} : u8[1,256]
  return %o
}}"""
    before = parse_graph(text)
    g, fired = UnaryToLut().run(before)
    assert fired == 1 and "lut(%a)" in print_graph(g)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
    np.testing.assert_array_equal(interpreter.run(g, codes)[0], interpreter.run(before, codes)[0])
    x = _qp(DType.U8, 0.125, 200)
    want = qmath.quantize_array(fn(qmath.dequantize_array(codes, x)),
                                _qp(DType.U8, 0.05, 100))
    np.testing.assert_array_equal(interpreter.run(g, codes)[0], want)


def test_scalar_arithmetic__a_tensor_constant_is_no_scalar():
    text = f"""graph @m {{
  %a = input() {{name='a'}} : u8[1,4]
  %da = dequant(%a) {{qp={QX}}} : f32[1,4]
  %c = const() {{value=array(f32, [4], [1.0, 2.0, 3.0, 4.0])}} : f32[4]
  %y = mul(%da, %c) : f32[1,4]
  %o = quant(%y) {{qp={QX}}} : u8[1,4]
  return %o
}}"""
    _, fired = UnaryToLut().run(parse_graph(text))
    assert fired == 0


class TinyAttention(nn.Module):
    """One attention block as BERT writes it: q/k/v projections, scores scaled by 1/sqrt(d),
    an additive padding mask, softmax, P·V, output projection."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.h, self.dh).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) * (self.dh ** -0.5)
        scores = scores + (1.0 - mask[:, None, None, :]) * -10000.0
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))


@pytest.fixture(scope="module")
def attention():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones(4, 8)
        mask[1, 6:] = 0
        mask[2, 3:] = 0
        return torch.randn(4, 8, 16, generator=g) * 2, mask

    batches = [batch() for _ in range(4)]
    q = quantize(TinyAttention().eval(), batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    return q, batches[1]


def test_attention__softmax_and_score_scale_are_int8_and_close_to_pt2e(attention):
    q, (x, mask) = attention
    r = lower(q, 4)
    assert r.stats["int8-softmax"] == 1 and r.stats["unary-to-lut"] >= 1
    ops = [n.op for n in r.graph.nodes()]
    assert Op.SOFTMAX not in ops and Op.QSOFTMAX in ops
    got = interpreter.run(r.graph, x.numpy(), mask.numpy())[0]
    want = q(x, mask).numpy()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_attention__cpu_and_ort_equal_the_reference_bit_for_bit(attention):
    q, (x, mask) = attention
    graph = lower(q, 4).graph
    want = interpreter.run(graph, x.numpy(), mask.numpy())
    cpu = compile_cpu(q, CompileOptions(batch_sizes=(4,), analyze=False)).runner.modules[4]
    for got, w in zip(cpu.module()(x.numpy(), mask.numpy()), want, strict=True):
        np.testing.assert_array_equal(got.view(w.dtype), w)
    ort, _ = build_ort({4: graph}, threads=1)
    for got, w in zip(ort.run_numpy(x.numpy(), mask.numpy()), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_attention__triton_kernels_equal_the_reference(attention):
    pytest.importorskip("triton")
    from qcompile.codegen.triton.target import CudaOptions, compile_cuda

    q, (x, mask) = attention
    model = compile_cuda(q, CompileOptions(batch_sizes=(4,), analyze=False),
                         CudaOptions(interpret=True))
    assert "qsoftmax" not in str(model.report["kernels"]["host_ops"])
    graph = model.runner.graphs[4]
    got = model.runner.programs[4].run_numpy(x.numpy(), mask.numpy())
    for g, w in zip(got, interpreter.run(graph, x.numpy(), mask.numpy()), strict=True):
        np.testing.assert_array_equal(g, w)


def test_attention__qsoftmax_kernel_compiles_for_sm90(attention):
    pytest.importorskip("triton")
    from qcompile.codegen.triton import aot, loader
    from qcompile.codegen.triton.lower import lower_graph

    q, _ = attention
    program = lower_graph(lower(q, 4).graph, loader.kernels(False), torch.device("cpu"))
    steps = [s for s in program.launches() if s.launch.kernel == "qsoftmax"]
    assert len(steps) == 1
    assert ".entry" in aot.compile_step(steps[0], 90).ptx

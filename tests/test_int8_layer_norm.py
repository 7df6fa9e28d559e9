"""int8 layer norm (QLAYERNORM): integer row statistics, an exact integer square root and a
fixed-point affine map. It stays within one output step of PT2E's float layer norm, and every
target (reference, cpu, ort, the Triton kernel under the interpreter) computes the same codes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from qcompile.codegen import cpu
from qcompile.codegen.ort.target import build as build_ort
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir import qmath
from qcompile.ir.graph import Graph, Op, node
from qcompile.ir.parser import parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.types import DType, QParams
from qcompile.ir.verify import verify
from qcompile.passes.int8_layer_norm import Int8LayerNorm
from qcompile.passes.residency import residency
from qcompile.passes.why_not_faster import why_not_faster
from qcompile.reference import interpreter
from qcompile.reference.program import lower

OUT = QParams(DType.U8, (0.04,), (120,), 0, 255)


def _qp(dtype: DType, scale: float, zp: int) -> QParams:
    return QParams(dtype, (scale,), (zp,), *dtype.range)


def _affine(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    gamma, beta = rng.normal(1.0, 0.3, n), rng.normal(0.0, 0.5, n)
    gamma[:3] = (-0.5, 0.0, 1e-4)                  # negative, zero and tiny gains
    return gamma, beta


def _codes(rng: np.random.Generator, dtype: DType, zp: int, rows: int, n: int) -> np.ndarray:
    lo, hi = dtype.range
    x = rng.integers(lo, hi + 1, size=(rows, n))
    x[0] = x[0, 0]                                  # a flat row: variance 0
    x[1] = np.clip(zp + rng.integers(-1, 2, n), lo, hi)    # a narrow row
    x[2, ::2], x[2, 1::2] = lo, hi                  # the widest row
    x[3] = lo
    x[3, 0] = hi                                    # one outlier: |x - mean| / std = sqrt(n - 1)
    return x.astype(dtype.np)


def _pt2e(codes: np.ndarray, x: QParams, gamma: np.ndarray, beta: np.ndarray, eps: float,
          out: QParams) -> np.ndarray:
    real = torch.from_numpy(qmath.dequantize_array(codes, x))
    y = nn.functional.layer_norm(real, (codes.shape[-1],), torch.from_numpy(gamma).float(),
                                 torch.from_numpy(beta).float(), eps)
    return qmath.quantize_array(y.numpy(), out).astype(np.int64)


CASES = [(DType.U8, 0.05, 128, 768, 1e-12), (DType.I8, 0.1, 0, 384, 1e-5),
         (DType.U8, 0.3, 10, 64, 1e-5), (DType.U8, 0.001, 128, qmath.LN_MAX_N, 1e-5)]


@pytest.mark.parametrize(("dtype", "scale", "zp", "n", "eps"), CASES)
def test_layernorm_codes__within_one_step_of_pt2e(dtype, scale, zp, n, eps):
    rng = np.random.default_rng(0)
    x, (gamma, beta) = _qp(dtype, scale, zp), _affine(rng, n)
    codes = _codes(rng, dtype, zp, 40, n)
    e, g, b, sh = qmath.layernorm_params(x, n, eps, gamma, beta, OUT.s)
    t = qmath.layernorm_fixed(codes, zp, e, g, b)
    diff = np.abs(qmath.layernorm_codes(t, sh, OUT.zp, (0, 255)) -
                  _pt2e(codes, x, gamma, beta, eps, OUT))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999


@pytest.mark.parametrize(("dtype", "scale", "zp", "n", "eps"), CASES)
def test_layernorm_float__matches_torch_to_float32_precision(dtype, scale, zp, n, eps):
    rng = np.random.default_rng(0)
    x, (gamma, beta) = _qp(dtype, scale, zp), _affine(rng, n)
    codes = _codes(rng, dtype, zp, 40, n)
    e, g, b, sh = qmath.layernorm_params(x, n, eps, gamma, beta, 1.0)
    got = qmath.layernorm_float(qmath.layernorm_fixed(codes, zp, e, g, b), sh)
    real = torch.from_numpy(qmath.dequantize_array(codes, x)).double()
    want = nn.functional.layer_norm(real, (n,), torch.from_numpy(gamma),
                                    torch.from_numpy(beta), eps).numpy()
    assert got.dtype == np.float32 and np.abs(got - want).max() < 2e-5 * np.abs(want).max()


def test_isqrt_rows__exact_below_2_to_53():
    rng = np.random.default_rng(1)
    v = np.concatenate([rng.integers(0, 2**53, 2000), np.arange(0, 300),
                        [(2**26 + 5) ** 2, (2**26 + 5) ** 2 - 1, 2**53 - 1]]).astype(np.int64)
    want = np.array([math.isqrt(int(a)) for a in v])
    np.testing.assert_array_equal(qmath.isqrt_rows(v), want)


def test_layernorm_params__refuses_what_would_overflow():
    x = _qp(DType.U8, 0.05, 128)
    ones, zeros = np.ones(4000), np.zeros(4000)
    assert qmath.layernorm_params(x, 4000, 1e-5, ones, zeros, 0.1) is None   # rows too long
    assert qmath.layernorm_params(x, 8, 1e9, ones[:8], zeros[:8], 0.1) is None  # eps vs s_x
    assert qmath.layernorm_params(x, 8, 1e-5, np.full(8, np.inf), zeros[:8], 0.1) is None


def _ln_graph(qx: str = "qp(u8, s=(0.125,), zp=(100,), range=(0, 255), axis=None)",
              extra: str = "", ret: str = "%o", w: str = "const() {value=array(f32, [4], "
              "[1.0, -0.5, 2.0, 0.25])}") -> str:
    return f"""graph @ln {{
  %a = input() {{name='a'}} : u8[2,3,4]
  %da = dequant(%a) {{qp={qx}}} : f32[2,3,4]
  %w = {w} : f32[4]
  %b = const() {{value=array(f32, [4], [0.0, 0.5, -1.0, 0.125])}} : f32[4]
  %y = layer_norm(%da, %w, %b) {{affine=True, eps=1e-05, normalized_shape=(4,)}} : f32[2,3,4]
  %o = quant(%y) {{qp=qp(u8, s=(0.03,), zp=(128,), range=(0, 255), axis=None)}} : u8[2,3,4]
{extra}  return {ret}
}}"""


def test_int8_layer_norm_pass__rewrites_verifies_and_keeps_the_codes():
    before = parse_graph(_ln_graph())
    g, fired = Int8LayerNorm().run(before)
    verify(g, stage="int8-layer-norm")
    text = print_graph(g)
    assert fired == 1 and "qlayernorm(%a)" in text and "layer_norm(" not in text
    codes = np.random.default_rng(0).integers(0, 256, (2, 3, 4)).astype(np.uint8)
    got, want = interpreter.run(g, codes)[0], interpreter.run(before, codes)[0]
    assert np.abs(got.astype(np.int64) - want).max() <= 1


@pytest.mark.parametrize("ret", ["%y", "%o, %f"])
def test_int8_layer_norm_pass__float_result_computed_in_integers(ret):
    extra = "  %f = relu(%y) : f32[2,3,4]\n" if "%f" in ret else ""
    before = parse_graph(_ln_graph(extra=extra, ret=ret))
    g, fired = Int8LayerNorm().run(before)
    verify(g, stage="int8-layer-norm")
    text = print_graph(g)
    assert fired == 1 and "layer_norm(" not in text and ": f32[2,3,4]" in text
    assert "qlayernorm(%a)" in text
    codes = np.random.default_rng(0).integers(0, 256, (2, 3, 4)).astype(np.uint8)
    for got, want in zip(interpreter.run(g, codes), interpreter.run(before, codes), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max() + 1)


def test_int8_layer_norm_pass__must_not_fire_on_a_computed_gain():
    text = _ln_graph(w="relu(%b)")
    text = text.replace("  %w = relu(%b) : f32[4]\n", "").replace(
        "  %y =", "  %w = relu(%b) : f32[4]\n  %y =")
    _, fired = Int8LayerNorm().run(parse_graph(text))
    assert fired == 0


def test_int8_layer_norm_pass__per_channel_input_normalizes_the_float_values():
    before = parse_graph(_ln_graph(
        qx="qp(u8, s=(0.1, 0.2, 0.3), zp=(0, 0, 0), range=(0, 255), axis=1)"))
    g, fired = Int8LayerNorm().run(before)
    verify(g, stage="int8-layer-norm")
    text = print_graph(g)
    assert fired == 1 and "qlayernorm(%0)" in text and "code_bits=" in text
    codes = np.random.default_rng(0).integers(0, 256, (2, 3, 4)).astype(np.uint8)
    got, want = interpreter.run(g, codes)[0], interpreter.run(before, codes)[0]
    assert np.abs(got.astype(np.int64) - want).max() <= 1


def _qln_graph(dtype: DType, scale: float, zp: int, n: int, rows: int) -> Graph:
    """The int8 and the float layer norm of one input, both as outputs."""
    rng = np.random.default_rng(2)
    x_qp = _qp(dtype, scale, zp)
    gamma, beta = _affine(rng, n)
    a = node(Op.INPUT, dtype, (rows, n), name="a")
    e, g, b, sh = qmath.layernorm_params(x_qp, n, 1e-5, gamma, beta, OUT.s)
    y = node(Op.QLAYERNORM, DType.U8, (rows, n), a, x_zp=zp, e=e, g=g, b=b, sh=sh, zp=OUT.zp,
             range=(3, 250))
    e, g, b, sh = qmath.layernorm_params(x_qp, n, 1e-5, gamma, beta, 1.0)
    f = node(Op.QLAYERNORM, DType.F32, (rows, n), a, x_zp=zp, e=e, g=g, b=b, sh=sh)
    return Graph("qln", (a,), (y, f))


def _cpu_and_ort_exact(graph: Graph, x: np.ndarray, rows: int) -> None:
    verify(graph, stage="test")
    want = interpreter.run(graph, x)
    for got, w in zip(cpu.compile_graph(graph, rows).module()(x), want, strict=True):
        np.testing.assert_array_equal(got.view(w.dtype), w)
    ort, _ = build_ort({rows: graph}, threads=1)
    for got, w in zip(ort.run_numpy(x), want, strict=True):
        np.testing.assert_array_equal(got, w)


def _triton_exact(graph: Graph, x: np.ndarray) -> None:
    pytest.importorskip("triton")
    from qcompile.codegen.triton import loader
    from qcompile.codegen.triton.lower import lower_graph

    program = lower_graph(graph, loader.kernels(True), torch.device("cpu"))
    assert [s.launch.kernel for s in program.launches()] == ["qlayernorm"] * 2
    for got, w in zip(program.run_numpy(x), interpreter.run(graph, x), strict=True):
        np.testing.assert_array_equal(got, w)


def _compiles_for_sm90(graph: Graph) -> None:
    pytest.importorskip("triton")
    from qcompile.codegen.triton import aot, loader
    from qcompile.codegen.triton.lower import lower_graph

    program = lower_graph(graph, loader.kernels(False), torch.device("cpu"))
    for step in program.launches():
        assert ".entry" in aot.compile_step(step, 90).ptx


TARGET_CASES = [(DType.U8, 0.05, 128, 384, 8), (DType.I8, 0.002, -3, qmath.LN_MAX_N, 6)]


@pytest.mark.parametrize(("dtype", "scale", "zp", "n", "rows"), TARGET_CASES)
def test_qlayernorm__cpu_and_ort_equal_the_reference_bit_for_bit(dtype, scale, zp, n, rows):
    _cpu_and_ort_exact(_qln_graph(dtype, scale, zp, n, rows),
                       _codes(np.random.default_rng(3), dtype, zp, rows, n), rows)


@pytest.mark.parametrize(("dtype", "scale", "zp", "n", "rows"), TARGET_CASES)
def test_qlayernorm__triton_kernel_equals_the_reference(dtype, scale, zp, n, rows):
    _triton_exact(_qln_graph(dtype, scale, zp, n, rows),
                  _codes(np.random.default_rng(3), dtype, zp, rows, n))


def test_qlayernorm__kernel_compiles_for_sm90():
    _compiles_for_sm90(_qln_graph(DType.U8, 0.05, 128, 384, 8))


class PostLN(nn.Module):
    """Two post-LN residual blocks, as BERT's: x = LN(x + Linear(x))."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.na, self.nb = nn.LayerNorm(d), nn.LayerNorm(d)
        with torch.no_grad():
            for norm in (self.na, self.nb):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.na(x + self.a(x))
        return self.nb(x + self.b(x))


def test_post_ln_model__layer_norms_int8_and_close_to_pt2e():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, 32, generator=g) * 2,) for _ in range(4)]
    q = quantize(PostLN().eval(), batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    r = lower(q, 4)
    assert r.stats["int8-layer-norm"] == 2                 # int8 out, then the float result
    lns = [n.dtype for n in r.graph.nodes() if n.op is Op.QLAYERNORM]
    assert sorted(d.value for d in lns) == ["f32", "u8"]
    assert Op.LAYER_NORM not in {n.op for n in r.graph.nodes()}
    # the float-result layer norm ends the int8 region like a dequantize: no float op is left,
    # so the integer-only gate passes under the error policy too
    assert residency(r.graph)["float_ops"] == [] and lower(q, 4, float_ops="error")
    assert why_not_faster(r.graph)["float_islands"] == []
    x = batches[1][0]
    got, want = interpreter.run(r.graph, x.numpy())[0], q(x).numpy()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


class WeightOnlyNorm(nn.Module):
    """A layer norm with a weight and no bias (``LayerNorm(bias=False)``) between linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16,
                                                                                       bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def test_weight_only_layer_norm__keeps_its_weight():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 16),) for _ in range(3)]
    q = quantize(WeightOnlyNorm().eval(), batches[0], batches,
                 QuantizeConfig(quantizer="qcompile"))
    r = lower(q, 4)
    assert r.stats["int8-layer-norm"] == 1
    x = batches[1][0]
    got, want = interpreter.run(r.graph, x.numpy())[0], q(x).numpy()
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


# -- the layer norm of a float input, in integers ---------------------------------------------

def _float_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows as a float residual stream has them: small features, one outlier channel, and the
    edge cases: a zero row, a tiny row, a constant row, a row far below eps, a huge row."""
    x = (rng.standard_normal((rows, n)) * 0.5).astype(np.float32)
    x[:, 7] = (190.0 * rng.standard_normal(rows)).astype(np.float32)
    x[1] = 0.0
    x[2] = np.float32(1e-30)
    x[3] = np.float32(3.0)
    x[4] = (1e-7 * rng.standard_normal(n)).astype(np.float32)
    x[5] = (3e37 * rng.standard_normal(n)).astype(np.float32)
    x[6, ::2] = np.float32(2.0**16)                  # codes at +-2^CB exactly
    x[6, 1::2] = np.float32(-(2.0**16))
    return x


def _fln_graph(n: int, rows: int, eps: float = 1e-12) -> Graph:
    """The float-input layer norm to int8 and to float, both as outputs."""
    rng = np.random.default_rng(5)
    gamma, beta = _affine(rng, n)
    a = node(Op.INPUT, DType.F32, (rows, n), name="a")
    cb, k_max, e, es, g, b, sh = qmath.layernorm_float_params(n, eps, gamma, beta, OUT.s)
    y = node(Op.QLAYERNORM, DType.U8, (rows, n), a, code_bits=cb, k_max=k_max, e=e, e_shift=es,
             g=g, b=b, sh=sh, zp=OUT.zp, range=(3, 250))
    cb, k_max, e, es, g, b, sh = qmath.layernorm_float_params(n, eps, gamma, beta, 1.0)
    f = node(Op.QLAYERNORM, DType.F32, (rows, n), a, code_bits=cb, k_max=k_max, e=e,
             e_shift=es, g=g, b=b, sh=sh)
    return Graph("fln", (a,), (y, f))


FLOAT_CASES = [(384, 12, 1e-12), (64, 8, 1e-5), (qmath.LN_MAX_N, 8, 0.0)]


@pytest.mark.parametrize(("n", "rows", "eps"), FLOAT_CASES)
def test_layernorm_fixed_float__close_to_torch(n, rows, eps):
    rng = np.random.default_rng(4)
    x = _float_rows(rng, rows, n)
    gamma, beta = _affine(rng, n)
    cb, k_max, e, es, g, b, sh = qmath.layernorm_float_params(n, eps, gamma, beta, 1.0)
    got = qmath.layernorm_float(qmath.layernorm_fixed_float(x, cb, k_max, e, es, g, b), sh)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (n,),
                                          torch.from_numpy(gamma), torch.from_numpy(beta),
                                          eps).numpy()
    if eps == 0.0:                       # torch: 0/0 on the constant rows; here: beta
        want[[1, 2, 3]] = beta
    # |c| <= 2^CB codes: each value within 2^-CB of the row's largest before normalization
    tol = 4.0 * 2.0**-cb * np.sqrt(n) * np.abs(gamma).max() + 1e-6
    assert np.abs(got - want).max() < tol


@pytest.mark.parametrize(("n", "rows", "eps"), FLOAT_CASES)
def test_qlayernorm_float_input__cpu_and_ort_equal_the_reference_bit_for_bit(n, rows, eps):
    _cpu_and_ort_exact(_fln_graph(n, rows, eps), _float_rows(np.random.default_rng(6), rows, n),
                       rows)


@pytest.mark.parametrize(("n", "rows", "eps"), FLOAT_CASES)
def test_qlayernorm_float_input__triton_kernel_equals_the_reference(n, rows, eps):
    _triton_exact(_fln_graph(n, rows, eps), _float_rows(np.random.default_rng(6), rows, n))


def test_qlayernorm_float_input__kernel_compiles_for_sm90():
    _compiles_for_sm90(_fln_graph(384, 8))


@pytest.mark.parametrize(("attr", "value"), [("code_bits", 30), ("k_max", 127), ("e", 2**42)])
def test_qlayernorm_float_input__verifier_refuses_overflowing_parameters(attr, value):
    from qcompile.ir.verify import VerifyError

    good = _fln_graph(384, 2)
    y = good.outputs[1]
    bad = node(Op.QLAYERNORM, DType.F32, y.shape, y.src[0], **{**dict(y.attrs), attr: value})
    verify(good, stage="test")
    with pytest.raises(VerifyError, match="qlayernorm on f32"):
        verify(Graph("bad", good.inputs, (bad,)), stage="test")

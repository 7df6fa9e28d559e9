"""Pass unit tests: QIR text before and after, firing counts, and cases that must not fire."""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.errors import UnsupportedGraphError
from qcompile.ir.graph import Op
from qcompile.ir.parser import parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.verify import VerifyError, verify
from qcompile.passes.cancel_dq_q import CancelDqQ
from qcompile.passes.check_integer_only import CheckIntegerOnly
from qcompile.passes.dead_code import DeadCode
from qcompile.passes.fold_relu_into_quant import FoldReluIntoQuant
from qcompile.passes.fold_weight_quant import FoldWeightQuant
from qcompile.passes.fuse_contraction_requant import FuseContractionRequant
from qcompile.passes.fuse_int8_add_mul import FuseInt8AddMul
from qcompile.passes.fuse_residual_add import FuseResidualAdd
from qcompile.passes.int8_data_movement import Int8DataMovement
from qcompile.passes.pipeline import run_pipeline
from qcompile.passes.unary_to_lut import UnaryToLut
from qcompile.reference import interpreter

QX = "qp(u8, s=(0.5,), zp=(10,), range=(0, 255), axis=None)"
QO = "qp(u8, s=(0.25,), zp=(3,), range=(0, 255), axis=None)"
QW = "qp(i8, s=(0.125, 0.25), zp=(0, 0), range=(-127, 127), axis=0)"
HEAD = f"""graph @t {{
  %x = input() {{name='x'}} : f32[1,4]
  %q = quant(%x) {{qp={QX}}} : u8[1,4]
  %dx = dequant(%q) {{qp={QX}}} : f32[1,4]
  %w = const() {{value=array(i8, [2, 4], [1, -2, 3, 4, 5, 6, -7, 8])}} : i8[2,4]
  %dw = dequant(%w) {{qp={QW}}} : f32[2,4]
  %b = const() {{value=array(f32, [2], [0.5, -1.0])}} : f32[2]
  %l = linear(%dx, %dw, %b) : f32[1,2]
"""


def graph(body: str, ret: str) -> str:
    return HEAD + body + f"  return {ret}\n}}\n"


def normalize(text: str) -> str:
    return print_graph(parse_graph(text))


def test_parse_print_round_trip():
    text = graph("", "%l")
    assert print_graph(parse_graph(print_graph(parse_graph(text)))) == normalize(text)


def test_fuse_contraction_requant__fuses_qdq_linear():
    g = parse_graph(graph(f"  %o = quant(%l) {{qp={QO}}} : u8[1,2]\n", "%o"))
    out, fired = FuseContractionRequant().run(g)
    assert fired == 1
    text = print_graph(out)
    assert "%3 = qlinear(%0, %1, %2) {x_zp=10} : i32[1,2]" in text
    # M = s_x*s_w[c]/s_out = 0.25, 0.5 = 2^30 * 2^-32, 2^30 * 2^-31
    assert "requant(%3) {rq=rq(u8, terms=(term(zp=0, m=(1073741824, 1073741824)),), " \
           "shift=(32, 31), zp=3, range=(0, 255), axis=1)} : u8[1,2]" in text
    assert "value=array(i32, [2], [8, -8])" in text   # bias / (s_x * s_w[c])
    verify(out)


def test_fuse_contraction_requant__leaves_linear_with_two_users_alone():
    body = f"  %o = quant(%l) {{qp={QO}}} : u8[1,2]\n  %r = relu(%l) : f32[1,2]\n"
    _, fired = FuseContractionRequant().run(parse_graph(graph(body, "%o, %r")))
    assert fired == 0


def test_fuse_contraction_requant__needs_int8_weights():
    text = graph(f"  %o = quant(%l) {{qp={QO}}} : u8[1,2]\n", "%o").replace(
        "linear(%dx, %dw, %b)", "linear(%dx, %fw, %b)").replace(
        "  %l =", "  %fw = const() {value=array(f32, [2, 4], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, "
                  "0.0, 0.0])} : f32[2,4]\n  %l =")
    _, fired = FuseContractionRequant().run(parse_graph(text))
    assert fired == 0


def test_fold_relu_into_quant__narrows_the_clamp():
    body = f"  %r = relu(%l) : f32[1,2]\n  %o = quant(%r) {{qp={QO}}} : u8[1,2]\n"
    g, fired = FoldReluIntoQuant().run(parse_graph(graph(body, "%o")))
    assert fired == 1
    assert "quant(%5) {qp=qp(u8, s=(0.25,), zp=(3,), range=(3, 255)" in print_graph(g)


def test_fold_relu_into_quant__relu6_upper_bound():
    body = (f"  %r = clamp(%l) {{lo=0.0, hi=6.0}} : f32[1,2]\n"
            f"  %o = quant(%r) {{qp={QO}}} : u8[1,2]\n")
    g, fired = FoldReluIntoQuant().run(parse_graph(graph(body, "%o")))
    assert fired == 1 and "range=(3, 27)" in print_graph(g)


def test_fold_weight_quant():
    text = """graph @w {
  %c = const() {value=array(f32, [2], [0.5, -1.0])} : f32[2]
  %q = quant(%c) {qp=qp(i8, s=(0.25,), zp=(0,), range=(-128, 127), axis=None)} : i8[2]
  return %q
}"""
    g, fired = FoldWeightQuant().run(parse_graph(text))
    assert fired == 1 and "array(i8, [2], [2, -4])" in print_graph(g)


def _two_inputs(op: str) -> str:
    return f"""graph @a {{
  %a = input() {{name='a'}} : u8[1,4]
  %b = input() {{name='b'}} : u8[1,4]
  %da = dequant(%a) {{qp={QX}}} : f32[1,4]
  %db = dequant(%b) {{qp={QO}}} : f32[1,4]
  %s = {op}(%da, %db) : f32[1,4]
  %o = quant(%s) {{qp={QO}}} : u8[1,4]
  return %o
}}"""


@pytest.mark.parametrize("op, expect", [("add", "requant(%a, %b)"), ("mul", "qmul(%a, %b)")])
def test_fuse_int8_add_mul(op, expect):
    g, fired = FuseInt8AddMul().run(parse_graph(_two_inputs(op)))
    assert fired == 1 and expect in print_graph(g)


def test_fuse_int8_add_mul__not_for_sub():
    _, fired = FuseInt8AddMul().run(parse_graph(_two_inputs("sub")))
    assert fired == 0


def test_fuse_residual_add():
    body = (f"  %r = input() {{name='r'}} : u8[1,2]\n  %dr = dequant(%r) {{qp={QO}}} : f32[1,2]\n"
            f"  %s = add(%l, %dr) : f32[1,2]\n  %o = quant(%s) {{qp={QO}}} : u8[1,2]\n")
    g, fired = FuseResidualAdd().run(parse_graph(graph(body, "%o")))
    assert fired == 1
    text = print_graph(g)
    assert "requant(%3, %r) {rq=rq(u8, terms=(term(zp=0, m=(268435456, 536870912)), " \
           "term(zp=3, m=(1073741824, 1073741824)),), shift=(30, 30)" in text


def test_int8_data_movement__reshape_and_rescale():
    text = f"""graph @m {{
  %a = input() {{name='a'}} : u8[1,4]
  %da = dequant(%a) {{qp={QX}}} : f32[1,4]
  %r = reshape(%da) {{shape=(2, 2)}} : f32[2,2]
  %o = quant(%r) {{qp={QO}}} : u8[2,2]
  %r2 = reshape(%da) {{shape=(4, 1)}} : f32[4,1]
  %o2 = quant(%r2) {{qp={QX}}} : u8[4,1]
  return %o, %o2
}}"""
    g, fired = Int8DataMovement().run(parse_graph(text))
    out = print_graph(g)
    assert fired == 2
    assert "reshape(%a) {shape=(2, 2)} : u8[2,2]" in out and "requant(%0)" in out
    assert "reshape(%a) {shape=(4, 1)} : u8[4,1]" in out   # same grid: no requant


def test_unary_to_lut_is_exact():
    text = f"""graph @u {{
  %a = input() {{name='a'}} : u8[1,256]
  %da = dequant(%a) {{qp={QX}}} : f32[1,256]
  %h = hardswish(%da) : f32[1,256]
  %o = quant(%h) {{qp={QO}}} : u8[1,256]
  return %o
}}"""
    before = parse_graph(text)
    g, fired = UnaryToLut().run(before)
    assert fired == 1 and "lut(%a)" in print_graph(g)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
    np.testing.assert_array_equal(interpreter.run(g, codes)[0], interpreter.run(before, codes)[0])


def test_cancel_dq_q():
    text = f"""graph @c {{
  %a = input() {{name='a'}} : u8[1,4]
  %da = dequant(%a) {{qp={QX}}} : f32[1,4]
  %o = quant(%da) {{qp={QX}}} : u8[1,4]
  %o2 = quant(%da) {{qp={QO}}} : u8[1,4]
  return %o, %o2
}}"""
    g, fired = CancelDqQ().run(parse_graph(text))
    assert fired == 2 and print_graph(g).splitlines()[-2] == "  return %a, %0"


def test_dead_code_removes_identity_reshape():
    text = """graph @d {
  %a = input() {name='a'} : f32[1,4]
  %r = reshape(%a) {shape=(1, 4)} : f32[1,4]
  %s = relu(%r) : f32[1,4]
  return %s
}"""
    g, fired = DeadCode().run(parse_graph(text))
    assert fired == 1 and "relu(%a)" in print_graph(g)


def test_check_integer_only__marks_and_errors():
    body = f"  %sm = softmax(%l) {{axis=1}} : f32[1,2]\n  %o = quant(%sm) {{qp={QO}}} : u8[1,2]\n" \
           f"  %do = dequant(%o) {{qp={QO}}} : f32[1,2]\n"
    g = parse_graph(graph(body, "%do"))
    marked, fired = CheckIntegerOnly().run(g)
    assert fired == 2   # the float linear and the softmax
    assert "softmax runs in float: int8-softmax needs" in print_graph(marked)
    with pytest.raises(UnsupportedGraphError, match=r"(?s)float op '\w+' survived.*next:"):
        CheckIntegerOnly("error").run(g)


def test_verifier_rejects_bad_requant():
    text = f"""graph @v {{
  %a = input() {{name='a'}} : f32[1,4]
  %q = quant(%a) {{qp={QX}}} : i8[1,4]
  return %q
}}"""
    with pytest.raises(VerifyError, match="quant needs qp whose dtype is the result dtype"):
        verify(parse_graph(text))


def test_pipeline_turns_linear_chain_integer_and_matches_pt2e_semantics():
    body = f"  %r = relu(%l) : f32[1,2]\n  %o = quant(%r) {{qp={QO}}} : u8[1,2]\n" \
           f"  %do = dequant(%o) {{qp={QO}}} : f32[1,2]\n"
    g = parse_graph(graph(body, "%do"))
    result = run_pipeline(g)
    ops = {n.op for n in result.graph.nodes()}
    assert Op.LINEAR not in ops and {Op.QLINEAR, Op.REQUANT} <= ops
    x = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32) * 20
    want = interpreter.run(g, x)[0]
    got = interpreter.run(result.graph, x)[0]
    assert np.max(np.abs(got - want)) <= 0.25 + 1e-6   # within one output step


@pytest.mark.parametrize(("args", "shape"), [("(('%', 0), (1,))", "[2,4]"),
                                              ("(('%', 0), (-2,), True)", "[2,1,4]")])
def test_int8_data_movement__float_sum_of_int8_is_an_exact_integer_sum(args, shape):
    text = f"""graph @s {{
  %a = input() {{name='a'}} : u8[2,3,4]
  %d = dequant(%a) {{qp=qp(u8, s=(0.1,), zp=(7,), range=(0, 255), axis=None)}} : f32[2,3,4]
  %s = float_op(%d) {{args={args}, kwargs=(), target='aten.sum.dim_IntList'}} : f32{shape}
  return %s
}}"""
    before = parse_graph(text)
    g, fired = Int8DataMovement().run(before)
    verify(g, stage="int8-data-movement")
    out = print_graph(g)
    assert fired == 1 and "qsum(%a)" in out and "float_op" not in out
    codes = np.random.default_rng(0).integers(0, 256, (2, 3, 4)).astype(np.uint8)
    got = interpreter.run(g, codes)[0]
    want = ((codes.astype(np.int64) - 7) * np.float32(0.1)).sum(axis=1,
                                                                keepdims="True" in args)
    np.testing.assert_allclose(got, want, rtol=1e-6)

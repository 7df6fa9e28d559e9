"""int8-mask-add: an additive attention mask computed from an integer mask becomes a table
lookup picked by the mask, exact for every integer mask value."""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.codegen import cpu
from qcompile.codegen.ort.target import build as build_ort
from qcompile.ir.graph import Graph, Node, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.ir.verify import verify
from qcompile.passes.int8_mask_add import Int8MaskAdd
from qcompile.reference import interpreter

SCORES = QParams(DType.U8, (0.125,), (200,), 0, 255)
OUT = QParams(DType.U8, (0.0625,), (255,), 0, 255)
F32 = DType.F32


def _const(v: float) -> Node:
    return node(Op.CONST, F32, (), value=np.asarray(v, np.float32))


def _graph(scale: float = -10000.0, *, root: DType = DType.I64, square: bool = False,
           moved: bool = False, lut: bool = False) -> Graph:
    """``quant(dequant(s) + (1 - float(m)) * scale)``: BERT's padding mask on (2, 3, 4, 5);
    ``moved``: the mask comes as (2, 5) and is reshaped after its conversion to float."""
    s = node(Op.INPUT, DType.U8, (2, 3, 4, 5), name="s")
    m = node(Op.INPUT, root, (2, 5) if moved else (2, 1, 1, 5), name="m")
    f = node(Op.FLOAT_OP, F32, m.shape, m, target="aten.to.dtype",
             args=(("%", 0), ("torch", "float32")), kwargs=()) if root is not F32 else m
    if moved:
        f = node(Op.RESHAPE, F32, (2, 1, 1, 5), f, shape=(2, 1, 1, 5))
    one_minus = node(Op.FLOAT_OP, F32, f.shape, f, target="aten.rsub.Scalar",
                     args=(("%", 0), 1.0), kwargs=())
    bias = node(Op.MUL, F32, f.shape, one_minus, _const(scale))
    if square:
        bias = node(Op.MUL, F32, f.shape, bias, bias)
    scores = node(Op.LUT, DType.U8, s.shape, s, table=(np.arange(256) * 7 + 3) % 256,
                  fn="mul") if lut else s
    total = node(Op.ADD, F32, s.shape, node(Op.DEQUANT, F32, s.shape, scores, qp=SCORES), bias)
    return Graph("mask", (s, m), (node(Op.QUANT, DType.U8, s.shape, total, qp=OUT),))


def _inputs(rng: np.random.Generator, dtype: DType = DType.I64, moved: bool = False
            ) -> list[np.ndarray]:
    s = rng.integers(0, 256, (2, 3, 4, 5)).astype(np.uint8)
    m = np.array([1, 1, 0, -3, 7, 0, 1, 2, -1, 1]).astype(dtype.np)
    return [s, m.reshape((2, 5) if moved else (2, 1, 1, 5))]


@pytest.mark.parametrize(("moved", "lut"), [(False, False), (True, False), (False, True)])
def test_int8_mask_add__a_table_per_mask_value_exact_for_any_integer(moved, lut):
    before = _graph(moved=moved, lut=lut)
    g, fired = Int8MaskAdd().run(before)
    verify(g, stage="int8-mask-add")
    (out,) = g.outputs
    assert fired == 1 and out.op is Op.MASK_LUT and out.attrs.table.shape == (4, 256)
    x = _inputs(np.random.default_rng(0), moved=moved)
    np.testing.assert_array_equal(interpreter.run(g, *x)[0], interpreter.run(before, *x)[0])
    assert out.src[1].dtype is DType.I64 and out.src[1].shape == (2, 1, 1, 5)
    assert out.src[0] is g.inputs[0]          # a table lookup before it folds into the tables
    assert np.all(out.attrs.table[0] == 0) and np.all(out.attrs.table[3] == 255)


@pytest.mark.parametrize("case", ["float-mask", "not-monotone", "does-not-saturate"])
def test_int8_mask_add__must_not_fire(case):
    graph = {"float-mask": lambda: _graph(root=F32), "not-monotone": lambda: _graph(square=True),
             "does-not-saturate": lambda: _graph(-0.5)}[case]()
    _, fired = Int8MaskAdd().run(graph)
    assert fired == 0


@pytest.mark.parametrize("dtype", [DType.I64, DType.I32])
def test_mask_lut__cpu_and_ort_equal_the_reference(dtype):
    g, _ = Int8MaskAdd().run(_graph(root=dtype))
    x = _inputs(np.random.default_rng(1), dtype)
    want = interpreter.run(g, *x)[0]
    got = cpu.compile_graph(g, 2).module()(*x)[0]
    np.testing.assert_array_equal(got.view(want.dtype), want)
    ort, _ = build_ort({2: g}, threads=1)
    np.testing.assert_array_equal(ort.run_numpy(*x)[0], want)


def test_mask_lut__triton_kernel_equals_the_reference():
    pytest.importorskip("triton")
    import torch

    from qcompile.codegen.triton import aot, loader
    from qcompile.codegen.triton.lower import lower_graph

    g, _ = Int8MaskAdd().run(_graph())
    x = _inputs(np.random.default_rng(2))
    program = lower_graph(g, loader.kernels(True), torch.device("cpu"))
    assert [s.launch.kernel for s in program.launches()] == ["mask_lut"]
    np.testing.assert_array_equal(program.run_numpy(*x)[0], interpreter.run(g, *x)[0])
    compiled = lower_graph(g, loader.kernels(False), torch.device("cpu"))
    assert ".entry" in aot.compile_step(compiled.launches()[0], 90).ptx

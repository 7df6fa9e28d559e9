"""Target ort (QIR → integer ONNX → ONNX Runtime): the requantize spelled in ONNX int64 ops equals
qmath.requantize bit for bit, every int8 tensor of the chain table equals the reference's, and
digits_cnn end to end agrees with the reference (exactly) and holds its recipe's thresholds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_reference import KINDS, Chain

from qcompile.accuracy.steps import output_steps, within_steps
from qcompile.codegen.ort.export import export
from qcompile.codegen.ort.target import build, compile_ort
from qcompile.codegen.target import CompileOptions
from qcompile.errors import UnsupportedGraphError
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir import qmath
from qcompile.ir.graph import Graph, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.pipeline import run_recipe
from qcompile.recipe import load_recipe
from qcompile.reference import interpreter
from qcompile.reference.program import lower

RECIPES = Path(__file__).parent.parent / "recipes"


def _quantized(kind: str, config: QuantizeConfig):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    return quantize(Chain(kind).eval(), batches[0], batches, config), batches[1][0]


def _every_int8_tensor(graph: Graph) -> Graph:
    """The same graph returning, besides its outputs, every int8 tensor it computes."""
    inner = [n for n in graph.nodes() if n.dtype.is_int8 and n.op not in (Op.CONST, Op.INPUT)]
    return graph.with_outputs((*graph.outputs, *inner))


def _run_onnx(graph: Graph, *inputs: np.ndarray) -> list[np.ndarray]:
    runner, _ = build({int(inputs[0].shape[0]): graph}, threads=1)
    return runner.run_numpy(*inputs)


@pytest.mark.parametrize("axis", [None, 3])
def test_requantize__onnx_int64_arithmetic_equals_qmath(axis):
    """Negative totals, exact ties (round half up), clamps, two terms sharing a shift, the
    largest shifts and multipliers: ``(v - Mod(v, 2^s)) / 2^s`` is the arithmetic shift."""
    rng = np.random.default_rng(0)
    channels = 5 if axis is not None else 1
    out = QParams(DType.I8, (1.0,), (3,), -128, 127)
    reals = [rng.uniform(1e-9, 0.9, channels), rng.uniform(1e-3, 1.5, channels)]
    reals[0][0] = 2.0**-40                    # shift 62 on channel 0 (and per tensor)
    rq = qmath.make_requant(reals, [0, -7], out, axis=axis, qmin=-100)
    shape = (2, 3, 4, channels)
    acc = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    acc.flat[:8] = [0, -1, 1, 2**31 - 1, -2**31, 2**20, -2**20, 7]
    res = rng.integers(-128, 128, shape).astype(np.int8)
    a = node(Op.INPUT, DType.I32, shape, name="acc")
    r = node(Op.INPUT, DType.I8, shape, name="res")
    y = node(Op.REQUANT, DType.I8, shape, a, r, rq=rq)
    got = _run_onnx(Graph("rq", (a, r), (y,)), acc, res)[0]
    np.testing.assert_array_equal(got, qmath.requantize(rq, acc, res))


def test_requantize__ties_round_half_up_like_qmath():
    out = QParams(DType.U8, (1.0,), (10,), 0, 255)
    rq = qmath.make_requant([[0.5]], [0], out, axis=None)
    x = node(Op.INPUT, DType.I32, (6,), name="x")
    g = Graph("ties", (x,), (node(Op.REQUANT, DType.U8, (6,), x, rq=rq),))
    values = np.array([1, 3, -1, -3, 1000, -1000], np.int32)
    np.testing.assert_array_equal(_run_onnx(g, values)[0], [11, 12, 10, 9, 255, 0])


CONFIGS = {"qcompile": QuantizeConfig(quantizer="qcompile"),
           "x86-float-islands": QuantizeConfig(quantizer="x86"),
           "int8-activations": QuantizeConfig(quantizer="qcompile",
                                              activations="per_tensor_symmetric")}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_chain__every_int8_tensor_equals_the_reference(kind, config):
    q, x = _quantized(kind, CONFIGS[config])
    graph = _every_int8_tensor(lower(q, 4).graph)
    got = _run_onnx(graph, x.numpy())
    want = interpreter.run(graph, x.numpy())
    for g, w, o in zip(got, want, graph.outputs, strict=True):
        assert g.dtype == w.dtype, o.loc
        if o.dtype.is_int8:
            np.testing.assert_array_equal(g, w, err_msg=o.loc or "")
        else:   # logits; float islands (x86) agree to float rounding
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    steps = output_steps(graph)[0]
    assert within_steps(got[0], want[0], steps) == 1.0


def test_ort_model__runs_any_batch_in_pieces_and_checks_inputs():
    from qcompile.errors import InputError

    q, x = _quantized("add_relu", CONFIGS["qcompile"])
    model = compile_ort(q, CompileOptions(batch_sizes=(1, 2)))
    assert sorted(model.runner.modules) == [1, 2]
    got = model(x[:3])
    want = np.concatenate([interpreter.run(lower(q, 1).graph, x[i:i + 1].numpy())[0]
                           for i in range(3)])
    np.testing.assert_array_equal(got.numpy(), want)
    assert model.report["compile"]["onnx"]["op_types"]["ConvInteger"] == 2
    with pytest.raises(InputError, match="shape is"):
        model(torch.zeros(1, 3, 10, 12))


def test_transformer_aten_ops__cast_rsub_sum_and_shape_only_ops_match_the_reference():
    """The aten ops the zoo's transformers leave as float_op (an attention mask's arithmetic)."""
    mask = node(Op.INPUT, DType.I64, (2, 5), name="mask")
    f = node(Op.FLOAT_OP, DType.F32, (2, 5), mask, target="aten._to_copy.default",
             args=(("%", 0),), kwargs=(("dtype", ("torch", "float32")),))
    inv = node(Op.FLOAT_OP, DType.F32, (2, 5), f, target="aten.rsub.Scalar",
               args=(("%", 0), 1.0, 2.0), kwargs=())
    total = node(Op.FLOAT_OP, DType.F32, (2,), inv, target="aten.sum.dim_IntList",
                 args=(("%", 0), (-1,), False), kwargs=())
    zeros = node(Op.FLOAT_OP, DType.F32, (2, 5), inv, target="aten.ones_like.default",
                 args=(("%", 0),), kwargs=())
    g = Graph("mask", (mask,), (total, node(Op.ADD, DType.F32, (2, 5), inv, zeros)))
    x = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], np.int64)
    for got, want in zip(_run_onnx(g, x), interpreter.run(g, x), strict=True):
        np.testing.assert_array_equal(got, want)


def test_export__op_without_lowering_is_an_error_naming_it():
    x = node(Op.INPUT, DType.F32, (2, 3), name="x")
    y = node(Op.FLOAT_OP, DType.F32, (2, 3), x, target="aten.erfinv.default", args=(("%", 0),),
             kwargs=(), loc="model.py:3 erfinv")
    with pytest.raises(UnsupportedGraphError, match="no ONNX lowering for 'aten.erfinv"):
        export(Graph("g", (x,), (y,)))


def test_digits_cnn_recipe_on_ort__exact_vs_reference_and_thresholds():
    report = run_recipe(load_recipe(RECIPES / "digits_cnn.yaml"), targets=["ort", "reference"])
    ort = report["targets"]["ort"]
    assert ort["status"] == "ok", ort.get("reason")
    e = ort["exactness"]["vs_reference"]
    assert e["mismatched"] == 0 and set(e["per_batch"]) >= {"1", "8"}, e
    assert ort["accuracy"]["passed"]
    ref = report["targets"]["reference"]["accuracy"]["compare"]
    assert ort["accuracy"]["compare"]["sqnr_db"] == pytest.approx(ref["sqnr_db"])

"""The fused int8 attention kernel (``qk_attention_u8``): alone (no IREE) bit-exact with the
reference semantics on odd shapes, signed and unsigned operands, shared, per-image and absent
masks; chosen by the cpu target only for the chains it computes, with the reason for the
others."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from qcompile.codegen import emit_ukernel, ukernel
from qcompile.ir.graph import Graph, Op, node
from qcompile.ir.types import DType, Requant, Term

needs_vnni = pytest.mark.skipif(shutil.which("gcc") is None or not ukernel.host_has_vnni(),
                                reason="needs gcc and an AVX-512 VNNI host")

_spec = importlib.util.spec_from_file_location(
    "ukernel_attention_bench", Path(__file__).resolve().parent.parent / "scripts" /
    "ukernel_attention_bench.py")
abench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(abench)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return abench.build(ukernel.SOURCE, tmp_path_factory.mktemp("attn"))


@needs_vnni
@pytest.mark.parametrize("vbmi", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ukernel.host_has_vbmi(), reason="needs AVX-512 VBMI"))])
@pytest.mark.parametrize("name", list(abench.CASES))
def test_attention_kernel__bit_exact_with_the_reference(lib, name, vbmi):
    c = abench.case(abench.CASES[name], np.random.default_rng(1), vbmi=vbmi)
    got, _ = abench.run(lib, c, 1)
    np.testing.assert_array_equal(got, c["ref"])


def test_attention_fits__head_size_and_stack_limits():
    assert ukernel.attention_fits(128, 32) is None
    assert ukernel.attention_fits(512, 32) is None
    assert "multiple of 4" in ukernel.attention_fits(128, 30)
    assert "stack" in ukernel.attention_fits(513, 32)
    assert "stack" in ukernel.attention_fits(512, 64)


def _rq(dtype: DType = DType.U8) -> Requant:
    lo, hi = dtype.range
    return Requant((Term(0, (1 << 30,)),), (40,), 0, lo, hi, dtype)


def _attention_graph(*, axis: int = 3, heads: int = 2, d: int = 8, s: int = 6,
                     scores_table: bool = False) -> Graph:
    """q·kᵀ → requant → [a table] → softmax(axis) → ·v → requant → head merge, on one
    [1, S, H·D] tensor."""
    x = node(Op.INPUT, DType.U8, (1, s, heads * d), name="x")
    split = node(Op.RESHAPE, DType.U8, (1, s, heads, d), x, shape=(1, s, heads, d))
    q = node(Op.PERMUTE, DType.U8, (1, heads, s, d), split, dims=(0, 2, 1, 3))
    kt = node(Op.PERMUTE, DType.U8, (1, heads, d, s), q, dims=(0, 1, 3, 2))
    qk = node(Op.QMATMUL, DType.I32, (1, heads, s, s), q, kt, a_zp=3, b_zp=5)
    rq1 = node(Op.REQUANT, DType.U8, qk.shape, qk, rq=_rq())
    table = np.arange(256, dtype=np.int64)[::-1].copy()
    scores = node(Op.LUT, DType.U8, qk.shape, rq1, fn="scale", table=table) \
        if scores_table else rq1
    sm = node(Op.QSOFTMAX, DType.U8, qk.shape, scores, axis=axis, m=1 << 24, zp=0,
              range=(0, 255), table=table)
    pv = node(Op.QMATMUL, DType.I32, (1, heads, s, d), sm, q, a_zp=0, b_zp=3)
    rq2 = node(Op.REQUANT, DType.U8, pv.shape, pv, rq=_rq())
    merge = node(Op.PERMUTE, DType.U8, (1, s, heads, d), rq2, dims=(0, 2, 1, 3))
    out = node(Op.RESHAPE, DType.U8, (1, s, heads * d), merge, shape=(1, s, heads * d))
    return Graph("attention", (x,), (out,))


def test_attention_chains__fused_with_every_inner_node():
    g = _attention_graph()
    chains, why = emit_ukernel.attention_chains(g, g.users())
    assert why == {}
    nodes = {id(n): n for a in chains.values() for n in (*a.inner, *a.merge)}
    assert set(chains) == set(nodes)
    ops = sorted(n.op.value for n in nodes.values())
    assert ops == sorted(["qmatmul", "requant", "qsoftmax", "qmatmul", "requant", "permute",
                          "reshape"])


def test_attention_chains__a_softmax_over_another_axis_keeps_the_stock_lowering():
    g = _attention_graph(axis=2)
    chains, why = emit_ukernel.attention_chains(g, g.users())
    assert chains == {} and why == {"softmax is not over the last of 4 axes": 1}


def test_attention_chains__heads_too_large_for_the_kernel_say_so():
    g = _attention_graph(d=130)
    chains, why = emit_ukernel.attention_chains(g, g.users())
    assert chains == {} and list(why) == ["head size 130 is not a multiple of 4 up to 128"]


def test_attention_chains__scores_through_another_table_keep_the_stock_lowering():
    g = _attention_graph(scores_table=True)
    chains, why = emit_ukernel.attention_chains(g, g.users())
    assert chains == {} and why == {"scores are not one per-tensor requantize": 1}

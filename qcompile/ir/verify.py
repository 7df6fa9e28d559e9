"""The QIR verifier: typing rules per op, checked after every pass.

A rule is a small function ``(node) -> problem or None``; the verifier names the first broken rule
with the node's printed line and location.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from qcompile.ir.graph import DATA_MOVEMENT, Graph, Node, Op
from qcompile.ir.types import DType, QParams, Requant


class VerifyError(ValueError):
    pass


Rule = Callable[[Node], str | None]


def _int_src(n: Node, *idx: int) -> str | None:
    for i in idx:
        if not n.src[i].dtype.is_int8:
            return f"operand {i} must be i8/u8, is {n.src[i].dtype.value}"
    return None


def _arity(n: Node, lo: int, hi: int | None = None) -> str | None:
    hi = lo if hi is None else hi
    return None if lo <= len(n.src) <= hi else f"takes {lo}..{hi} operands, has {len(n.src)}"


def _const(n: Node) -> str | None:
    v = n.attrs.get("value")
    if not isinstance(v, np.ndarray):
        return "const needs an array 'value'"
    if tuple(v.shape) != n.shape or DType.of_numpy(v.dtype) is not n.dtype:
        return f"value is {v.dtype}{list(v.shape)}, node says {n.dtype.value}{list(n.shape)}"
    return None


def _quant(n: Node) -> str | None:
    qp = n.attrs.get("qp")
    if not isinstance(qp, QParams) or qp.dtype is not n.dtype:
        return "quant needs qp whose dtype is the result dtype"
    return None if n.src[0].dtype.is_float else "quant reads f32"


def _dequant(n: Node) -> str | None:
    if not isinstance(n.attrs.get("qp"), QParams):
        return "dequant needs qp"
    if n.src[0].dtype not in (DType.I8, DType.U8, DType.I32):
        return "dequant reads i8/u8/i32"
    return None if n.dtype.is_float else "dequant yields f32"


def _contraction(n: Node) -> str | None:
    if n.dtype is not DType.I32:
        return "integer contraction yields i32"
    if n.op in (Op.QCONV2D, Op.QLINEAR):
        w, b = n.src[1], n.src[2]
        if w.op is not Op.CONST or w.dtype is not DType.I8:
            return "weights must be an i8 const"
        if b.op is not Op.CONST or b.dtype is not DType.I32:
            return "bias must be an i32 const"
        return _int_src(n, 0)
    return _int_src(n, *range(len(n.src)))


def _requant(n: Node) -> str | None:
    rq = n.attrs.get("rq")
    if not isinstance(rq, Requant):
        return "requant needs rq"
    if len(rq.terms) != len(n.src) or rq.out_dtype is not n.dtype:
        return f"rq has {len(rq.terms)} terms for {len(n.src)} operands / wrong dtype"
    if any(s.dtype not in (DType.I8, DType.U8, DType.I32) for s in n.src):
        return "requant reads integers"
    if rq.axis is not None and n.shape[rq.axis] != rq.channels:
        return f"rq has {rq.channels} channels, axis {rq.axis} has {n.shape[rq.axis]}"
    return None


def _lut(n: Node) -> str | None:
    t = n.attrs.get("table")
    if not isinstance(t, np.ndarray) or t.shape != (256,) or DType.of_numpy(t.dtype) is not n.dtype:
        return "lut needs a 256-entry table of the result dtype"
    return _int_src(n, 0)


def _same_dtype(n: Node) -> str | None:
    if n.src and n.src[0].dtype.is_int8 and any(s.dtype is not n.dtype for s in n.src):
        return "int8 data movement keeps the dtype of its operands"
    return None


RULES: dict[Op, tuple[Rule, ...]] = {
    Op.INPUT: (lambda n: _arity(n, 0),
               lambda n: None if "name" in n.attrs else "input needs a name"),
    Op.CONST: (lambda n: _arity(n, 0), _const),
    Op.QUANT: (lambda n: _arity(n, 1), _quant),
    Op.DEQUANT: (lambda n: _arity(n, 1), _dequant),
    Op.QCONV2D: (lambda n: _arity(n, 3), _contraction),
    Op.QLINEAR: (lambda n: _arity(n, 3), _contraction),
    Op.QMATMUL: (lambda n: _arity(n, 2), _contraction),
    Op.QMUL: (lambda n: _arity(n, 2), _contraction),
    Op.QSUMPOOL2D: (lambda n: _arity(n, 1), _contraction),
    Op.QSUM: (lambda n: _arity(n, 1), _contraction),
    Op.REQUANT: (lambda n: _arity(n, 1, 8), _requant),
    Op.LUT: (lambda n: _arity(n, 1), _lut),
    **{op: (_same_dtype,) for op in DATA_MOVEMENT},
}


def _shape_ok(n: Node) -> str | None:
    if any(d < 0 for d in n.shape):
        return f"negative dimension in {list(n.shape)}"
    return None


def verify(g: Graph, *, stage: str = "") -> None:
    """Raise :class:`VerifyError` on the first node that breaks a rule."""
    for n in g.nodes():
        for rule in (_shape_ok, *RULES.get(n.op, ())):
            problem = rule(n)
            if problem:
                where = f" after {stage}" if stage else ""
                raise VerifyError(f"QIR verifier{where}: {n.op.value} at {n.loc or '?'}: "
                                  f"{problem}")

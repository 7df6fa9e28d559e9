r"""int8-data-movement

    dequant(x_q)                                   x_q
         |                                          |
    maxpool / reshape / permute / pad / cat  ==>  the same op on int8 (pad value = zero point)
    avgpool / mean                                 QSUMPOOL2D / QSUM -> i32
         |                                          |
    quant(qp_out)                                  REQUANT onto qp_out (only where grids differ;
                                                   avgpool/mean divide by the window size here)

    sum(dequant(x_q), dims) -> f32          ==>    dequant(QSUM(x_q, dims) -> i32; s_x)

Pools and data movement never leave int8: max and reshape commute with quantization, and sums
are exact in i32. A float sum of int8 values (MiniLM's mean pooling over tokens) is the exact
integer sum dequantized once, where a float sum rounds differently with each target's order.
"""

from __future__ import annotations

import math

from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.passes._build import requant, rescale
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer

MOVES = (Op.MAXPOOL2D, Op.RESHAPE, Op.PERMUTE, Op.PAD)


class Int8DataMovement(RewritePass):
    name = "int8-data-movement"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if n.op is Op.FLOAT_OP:
            return _float_sum(n)
        inner = quantized_producer(n, ctx)
        if inner is None:
            return None
        if inner.op is Op.CAT:
            return _cat(n, inner)
        x_qp = dequant_of(inner.src[0]) if inner.src else None
        if x_qp is None or not x_qp.per_tensor:
            return None
        x, out = inner.src[0].src[0], n.attrs.qp
        if inner.op in MOVES:
            if inner.op is Op.PAD and inner.attrs.value != 0.0:
                return None
            attrs = inner.attrs.replace(value=x_qp.zp) if inner.op is Op.PAD else inner.attrs
            moved = inner.with_(dtype=x.dtype, src=(x,), attrs=attrs)
            return rescale(moved, x_qp, out, loc=n.loc)
        if inner.op in (Op.AVGPOOL2D, Op.MEAN):
            return _sum_then_requant(n, inner, x, x_qp)
        return None


def _sum_then_requant(n: Node, inner: Node, x: Node, x_qp) -> Node:  # type: ignore[no-untyped-def]
    out = n.attrs.qp
    if inner.op is Op.AVGPOOL2D:
        count = inner.attrs.divisor
        acc = node(Op.QSUMPOOL2D, DType.I32, inner.shape, x, loc=inner.loc, x_zp=x_qp.zp,
                   layout="nchw", **inner.attrs.without("divisor"))
    else:
        count = 1
        for d in inner.attrs.dims:
            count *= x.shape[d]
        acc = node(Op.QSUM, DType.I32, inner.shape, x, loc=inner.loc, x_zp=x_qp.zp,
                   dims=inner.attrs.dims, keepdim=inner.attrs.keepdim)
    return requant([acc], [[x_qp.s / (out.s * count)]], [0], out, n.shape, axis=None, loc=n.loc)


def _float_sum(n: Node) -> Node | None:
    """``aten.sum.dim_IntList(dequant(x_q), dims[, keepdim])`` as an exact i32 sum, dequantized
    (``qmath.dequantize_array``: one rounding)."""
    a = n.attrs
    if a.target != "aten.sum.dim_IntList" or a.kwargs or not 2 <= len(a.args) <= 3 or \
            a.args[0] != ("%", 0) or not isinstance(a.args[1], tuple):
        return None
    x_qp = dequant_of(n.src[0])
    if x_qp is None or not x_qp.per_tensor:
        return None
    x = n.src[0].src[0]
    dims = tuple(sorted(d % len(x.shape) for d in a.args[1]))
    keepdim = bool(a.args[2]) if len(a.args) == 3 else False
    if math.prod(x.shape[d] for d in dims) * 255 >= 2**31:
        return None
    acc = node(Op.QSUM, DType.I32, n.shape, x, loc=n.loc, x_zp=x_qp.zp, dims=dims,
               keepdim=keepdim)
    qp = QParams(DType.I32, (x_qp.s,), (0,), *DType.I32.range)
    return node(Op.DEQUANT, DType.F32, n.shape, acc, qp=qp, loc=n.loc)


def _cat(n: Node, cat: Node) -> Node | None:
    qps = [dequant_of(s) for s in cat.src]
    if any(q is None or not q.per_tensor for q in qps):
        return None
    out = n.attrs.qp
    parts = tuple(rescale(s.src[0], q, out, loc=n.loc) for s, q in zip(cat.src, qps, strict=True))
    if any(p.dtype is not out.dtype for p in parts):
        return None
    joined = cat.with_(dtype=out.dtype, src=parts)
    from dataclasses import replace

    # the parts are on the output grid now; only a narrowed clamp range is left to apply
    return rescale(joined, replace(out, qmin=out.dtype.range[0], qmax=out.dtype.range[1]), out,
                   loc=n.loc)

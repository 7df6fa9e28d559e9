"""Constructors the fusion passes share: requantize nodes and int8 contraction anchors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType, QParams


def requant(srcs: Sequence[Node], reals: Sequence[Sequence[float]], zps: Sequence[int],
            out: QParams, shape: tuple[int, ...], *, axis: int | None,
            loc: str | None) -> Node:
    """``REQUANT(srcs)`` onto ``out`` with per-term real multipliers."""
    rq = qmath.make_requant(reals, zps, out, axis=axis)
    return node(Op.REQUANT, out.dtype, shape, *srcs, rq=rq, loc=loc)


def rescale(x: Node, x_qp: QParams, out: QParams, *, loc: str | None) -> Node:
    """int8 → int8 onto another grid; ``x`` itself when nothing changes."""
    from qcompile.passes.base import full_range, same_grid

    if same_grid(x_qp, out) and (full_range(out) or (out.qmin, out.qmax) == (x_qp.qmin,
                                                                              x_qp.qmax)):
        return x
    return requant([x], [[x_qp.s / out.s]], [x_qp.zp], out, x.shape, axis=None, loc=loc)


def const(value: np.ndarray, loc: str | None = None) -> Node:
    return node(Op.CONST, DType.of_numpy(value.dtype), value.shape, value=value, loc=loc)


def weight_ok(dq_w: Node) -> QParams | None:
    """QParams of a weight ``dequant(const i8)``, symmetric, per tensor or per output channel."""
    if dq_w.op is not Op.DEQUANT or dq_w.src[0].op is not Op.CONST:
        return None
    qp = dq_w.attrs.qp
    if qp.dtype is not DType.I8 or not qp.symmetric or qp.axis not in (None, 0):
        return None
    return qp


def bias_i32(bias: Node | None, acc_scale: np.ndarray, channels: int,
             loc: str | None) -> Node | None:
    """The float bias quantized to i32 at ``acc_scale`` (zeros when there is no bias)."""
    if bias is None:
        return const(np.zeros(channels, dtype=np.int32), loc)
    if bias.op is not Op.CONST or bias.dtype is not DType.F32:
        return None
    return const(qmath.quantize_bias(bias.attrs.value, np.broadcast_to(acc_scale, (channels,))),
                 loc)

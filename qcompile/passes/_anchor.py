"""Turning a float contraction over dequantized operands into its int8 anchor (i32 result)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType
from qcompile.passes._build import bias_i32, weight_ok
from qcompile.passes.base import dequant_of


@dataclass(frozen=True)
class Anchor:
    acc: Node                 # the i32 QCONV2D / QLINEAR / QMATMUL node
    scale: np.ndarray         # real value of one accumulator unit, per output channel
    axis: int | None          # output channel axis of ``scale`` (None: per tensor)
    weight: Node | None       # the i8 weight constant (None for activation x activation)


def int8_anchor(n: Node) -> Anchor | None:
    """``conv2d/linear/matmul(dequant(x), dequant(W) [, bias])`` as an integer anchor."""
    if n.op in (Op.CONV2D, Op.LINEAR):
        return _weighted(n)
    if n.op is Op.MATMUL:
        return _matmul(n)
    return None


def _weighted(n: Node) -> Anchor | None:
    x_qp, w_qp = dequant_of(n.src[0]), weight_ok(n.src[1])
    if x_qp is None or w_qp is None or not x_qp.per_tensor:
        return None
    w = n.src[1].src[0]
    channels = w.shape[0]
    scale = np.broadcast_to(qmath.acc_scales(x_qp, w_qp), (channels,))
    bias = bias_i32(n.src[2] if len(n.src) > 2 else None, scale, channels, n.loc)
    if bias is None:
        return None
    op = Op.QCONV2D if n.op is Op.CONV2D else Op.QLINEAR
    attrs = dict(n.attrs)
    if op is Op.QCONV2D:
        attrs["layout"] = "nchw"
    acc = node(op, DType.I32, n.shape, n.src[0].src[0], w, bias, loc=n.loc, x_zp=x_qp.zp,
               **attrs)
    axis = 1 if op is Op.QCONV2D else len(n.shape) - 1
    return Anchor(acc, scale, axis, w)


def _matmul(n: Node) -> Anchor | None:
    a_qp, b_qp = dequant_of(n.src[0]), dequant_of(n.src[1])
    if a_qp is None or b_qp is None or not (a_qp.per_tensor and b_qp.per_tensor):
        return None
    acc = node(Op.QMATMUL, DType.I32, n.shape, n.src[0].src[0], n.src[1].src[0], loc=n.loc,
               a_zp=a_qp.zp, b_zp=b_qp.zp)
    return Anchor(acc, np.asarray([a_qp.s * b_qp.s]), None, None)

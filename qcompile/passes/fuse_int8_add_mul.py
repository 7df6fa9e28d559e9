r"""fuse-int8-add-mul

    dequant(a_q)  dequant(b_q)                 a_q   b_q
          \        /                             \   /
          add / mul          ==>     add: REQUANT(terms (a - zp_a) * M_a, (b - zp_b) * M_b) -> i8
            |                        mul: REQUANT(QMUL(a, b) -> i32, M = s_a*s_b/s_out)   -> i8
    quant(s_out, zp_out)

Both operands must be int8 already (requantized by their producers); adds need equal shapes
(a broadcasting add stays float and is reported).
"""

from __future__ import annotations

from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType
from qcompile.passes._build import requant
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer


class FuseInt8AddMul(RewritePass):
    name = "fuse-int8-add-mul"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx, frozenset({Op.ADD, Op.MUL}))
        if inner is None:
            return None
        qa, qb = dequant_of(inner.src[0]), dequant_of(inner.src[1])
        if qa is None or qb is None or not (qa.per_tensor and qb.per_tensor):
            return None
        a, b, out = inner.src[0].src[0], inner.src[1].src[0], n.attrs.qp
        if inner.op is Op.ADD:
            if a.shape != n.shape or b.shape != n.shape:
                return None
            return requant([a, b], [[qa.s / out.s], [qb.s / out.s]], [qa.zp, qb.zp], out,
                           n.shape, axis=None, loc=n.loc)
        prod = node(Op.QMUL, DType.I32, inner.shape, a, b, a_zp=qa.zp, b_zp=qb.zp, loc=inner.loc)
        return requant([prod], [[qa.s * qb.s / out.s]], [0], out, n.shape, axis=None, loc=n.loc)

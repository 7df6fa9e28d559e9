r"""int8-softmax

    dequant(x_q)                     x_q
         |                            |
    softmax(axis)          ==>   QSOFTMAX(axis, exp table of s_x, M = 2^16 / s_out)  -> int8
         |
    quant(qp_out)

Softmax is shift-invariant, so on one row of int8 codes it depends only on each code's distance
to the row's largest (0..255): ``exp`` becomes a 256-entry integer table, the row sum an i64
reduction and the division one integer divide per element (``qcompile.ir.qmath``). The int8
scores never leave integers between Q·Kᵀ and P·V. It differs from PT2E's float softmax by at
most one output step, and only where PT2E's value lies within about 2^-22 of a rounding tie.
"""

from __future__ import annotations

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op, node
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer


class Int8Softmax(RewritePass):
    name = "int8-softmax"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx, frozenset({Op.SOFTMAX}))
        if inner is None:
            return None
        x_qp = dequant_of(inner.src[0])
        out = n.attrs.qp
        if x_qp is None or not x_qp.per_tensor or out.s < 2.0**-14 or \
                n.shape[inner.attrs.axis] >= 2**20:
            return None        # finer outputs or longer rows could overflow the i64 terms
        return node(Op.QSOFTMAX, n.dtype, n.shape, inner.src[0].src[0],
                    axis=inner.attrs.axis % len(n.shape), table=qmath.softmax_table(x_qp),
                    m=qmath.softmax_multiplier(out), zp=int(out.zero_point[0]),
                    range=(int(out.qmin), int(out.qmax)), loc=inner.loc)

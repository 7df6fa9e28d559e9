r"""cancel-dq-q

    x_q -> dequant(qp_a) -> quant(qp_b)   ==>   x_q                       (same grid)
                                          ==>   REQUANT(x_q, M = s_a/s_b)  (another grid)
"""

from __future__ import annotations

from qcompile.ir.graph import Node, Op
from qcompile.passes._build import rescale
from qcompile.passes.base import Context, RewritePass, dequant_of


class CancelDqQ(RewritePass):
    name = "cancel-dq-q"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if n.op is not Op.QUANT or not n.attrs.qp.per_tensor:
            return None
        x_qp = dequant_of(n.src[0])
        if x_qp is None or not x_qp.per_tensor:
            return None
        return rescale(n.src[0].src[0], x_qp, n.attrs.qp, loc=n.loc)

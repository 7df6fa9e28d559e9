r"""unary-to-lut

    dequant(x_q)                        x_q
         |                               |
    hardswish / gelu / silu / ...  ==>  LUT(table[256] = Q_out(f(DQ_x(code))))  -> int8
         |
    quant(qp_out)

Any elementwise function of one int8 tensor has only 256 possible inputs: its int8 result is a
table lookup, exact with respect to PT2E's float computation.
"""

from __future__ import annotations

import numpy as np
import torch

from qcompile.ir import qmath
from qcompile.ir.graph import UNARY_FLOAT, Node, Op, node
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer


class UnaryToLut(RewritePass):
    name = "unary-to-lut"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx, UNARY_FLOAT)
        if inner is None:
            return None
        x_qp = dequant_of(inner.src[0])
        if x_qp is None or not x_qp.per_tensor:
            return None
        from qcompile.reference.interpreter import float_fn

        fn = float_fn(inner)
        table = qmath.lut_table(lambda v: fn(torch.from_numpy(v)).numpy(), x_qp, n.attrs.qp)
        return node(Op.LUT, n.dtype, n.shape, inner.src[0].src[0], table=np.asarray(table),
                    fn=inner.op.value, loc=inner.loc)

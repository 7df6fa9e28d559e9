r"""fuse-residual-add

    conv2d/linear/matmul(dequant ...)   dequant(r_q)          QCONV2D ... -> i32     r_q
                      \                  /                            \             /
                          add  f32                  ==>        REQUANT(terms: acc * M_acc[c],
                           |                                           (r - zp_r) * M_r[c])
                     quant(s_out, zp_out)                               -> i8

The residual joins the epilogue of the chain that produces the other operand: one kernel computes
``conv + bias + residual`` (and the relu that fold-relu-into-quant turned into the clamp).
"""

from __future__ import annotations

import numpy as np

from qcompile.ir.graph import Node, Op
from qcompile.passes._anchor import int8_anchor
from qcompile.passes._build import requant
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer


class FuseResidualAdd(RewritePass):
    name = "fuse-residual-add"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        add = quantized_producer(n, ctx, frozenset({Op.ADD}))
        if add is None:
            return None
        for main, other in ((add.src[0], add.src[1]), (add.src[1], add.src[0])):
            r_qp = dequant_of(other)
            if r_qp is None or not r_qp.per_tensor or other.shape != add.shape:
                continue
            if main.shape != add.shape or not ctx.single_user(main):
                continue
            anchor = int8_anchor(main)
            if anchor is None:
                continue
            out = n.attrs.qp
            reals = [anchor.scale / out.s, np.full_like(anchor.scale, r_qp.s / out.s)]
            return requant([anchor.acc, other.src[0]], reals, [0, r_qp.zp], out, n.shape,
                           axis=anchor.axis, loc=n.loc)
        return None

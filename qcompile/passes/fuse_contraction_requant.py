r"""fuse-contraction-requant

    dequant(x_q)  dequant(W_i8)  bias f32            x_q   W_i8   bias_i32 (scale s_x*s_w)
           \          |          /                     \    |     /
         conv2d / linear / matmul   f32      ==>       QCONV2D / QLINEAR / QMATMUL -> i32
                      |                                          |
                 quant(s_out, zp_out)                 REQUANT(M = s_x*s_w[c]/s_out, zp_out) -> i8

The i32 accumulator and its requantize form one chain: code generation keeps the accumulator in
registers and writes only int8.
"""

from __future__ import annotations

from qcompile.ir.graph import Node
from qcompile.passes._anchor import int8_anchor
from qcompile.passes._build import requant
from qcompile.passes.base import Context, RewritePass, quantized_producer


class FuseContractionRequant(RewritePass):
    name = "fuse-contraction-requant"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx)
        if inner is None:
            return None
        anchor = int8_anchor(inner)
        if anchor is None:
            return None
        out = n.attrs.qp
        return requant([anchor.acc], [anchor.scale / out.s], [0], out, n.shape,
                       axis=anchor.axis, loc=n.loc)

r"""fuse-contraction-dequant

    dequant(x_q)  dequant(W_i8)  bias            x_q   W_i8   bias_i32
           \          |         /                   \    |     /
          conv2d / linear / matmul      ==>     QCONV2D / QLINEAR / QMATMUL -> i32
                      |  (no quant after it)                  |
                                                  DEQUANT(scale s_x*s_w[c]) -> f32

For contractions whose result leaves int8 (the logits of a classifier): the arithmetic is still
integer; only the final scaling is float. Runs after the requantizing fusions.
"""

from __future__ import annotations

from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.passes._anchor import int8_anchor
from qcompile.passes.base import Context, RewritePass


class FuseContractionDequant(RewritePass):
    name = "fuse-contraction-dequant"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        anchor = int8_anchor(n)
        if anchor is None:
            return None
        channels = len(anchor.scale)
        qp = QParams(DType.I32, tuple(float(s) for s in anchor.scale), (0,) * channels,
                     *DType.I32.range, anchor.axis if channels > 1 else None)
        return node(Op.DEQUANT, DType.F32, n.shape, anchor.acc, qp=qp, loc=n.loc)

r"""fold-weight-quant

    const f32 W                          const i8 W_q  (= quantize(W), computed now)
        |                   ==>
    quant(qp)

First in the pipeline, so every weight ``dequant`` then reads an int8 constant.
"""

from __future__ import annotations

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op
from qcompile.passes._build import const
from qcompile.passes.base import Context, RewritePass


class FoldWeightQuant(RewritePass):
    name = "fold-weight-quant"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if n.op is not Op.QUANT or n.src[0].op is not Op.CONST:
            return None
        return const(qmath.quantize_array(n.src[0].attrs.value, n.attrs.qp), n.loc)

r"""fold-relu-into-quant

    x f32                                 x f32
      |                                     |
    relu / clamp(lo, hi)       ==>        quant(qp, range=[max(qmin, q(lo)), min(qmax, q(hi))])
      |
    quant(qp)

Exact: rounding is monotonic, so ``Q(clamp(x, lo, hi)) == clamp(Q(x), Q(lo), Q(hi))``. The narrowed
range becomes the clamp of the requantize that later fusions produce.
"""

from __future__ import annotations

import dataclasses
import math

from qcompile.ir.graph import Node, Op
from qcompile.passes.base import Context, RewritePass, quantized_producer


def _code(v: float, s: float, zp: int) -> int:
    return int(round(v / s)) + zp   # Python's round is half-to-even, as PT2E's torch.round


class FoldReluIntoQuant(RewritePass):
    name = "fold-relu-into-quant"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        act = quantized_producer(n, ctx, frozenset({Op.RELU, Op.CLAMP}))
        if act is None:
            return None
        qp = n.attrs.qp
        lo, hi = (0.0, math.inf) if act.op is Op.RELU else (act.attrs.lo, act.attrs.hi)
        qmin = qp.qmin if lo is None else max(qp.qmin, _code(lo, qp.s, qp.zp))
        qmax = qp.qmax if hi is None or math.isinf(hi) else min(qp.qmax, _code(hi, qp.s, qp.zp))
        if qmin > qmax:
            return None
        narrowed = dataclasses.replace(qp, qmin=qmin, qmax=qmax)
        return n.with_(src=act.src[:1], attrs=n.attrs.replace(qp=narrowed))

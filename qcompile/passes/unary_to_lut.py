r"""unary-to-lut

    dequant(x_q)                        x_q
         |                               |
    hardswish / gelu / silu / ...  ==>  LUT(table[256] = Q_out(f(DQ_x(code))))  -> int8
    or x (+ - * /) scalar constant
         |
    quant(qp_out)

Any elementwise function of one int8 tensor has only 256 possible inputs: its int8 result is a
table lookup, exact with respect to PT2E's float computation. That includes arithmetic with a
scalar constant (attention's ``scores * 1/sqrt(d)``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qcompile.ir import qmath
from qcompile.ir.graph import UNARY_FLOAT, Node, Op, node
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer

SCALAR_ARITH = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV})


class UnaryToLut(RewritePass):
    name = "unary-to-lut"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx, UNARY_FLOAT | SCALAR_ARITH)
        if inner is None:
            return None
        from qcompile.reference.interpreter import float_fn

        fn = float_fn(inner)
        if inner.op in SCALAR_ARITH:
            found = _with_scalar(inner, fn)
            if found is None:
                return None
            x, fn = found
        else:
            x = inner.src[0]
        x_qp = dequant_of(x)
        if x_qp is None or not x_qp.per_tensor or x.shape != n.shape:
            return None
        table = qmath.lut_table(lambda v: fn(torch.from_numpy(v)).numpy(), x_qp, n.attrs.qp)
        return node(Op.LUT, n.dtype, n.shape, x.src[0], table=np.asarray(table),
                    fn=inner.op.value, loc=inner.loc)


def _with_scalar(n: Node, fn: Callable[..., torch.Tensor]
                 ) -> tuple[Node, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(x, v -> fn(v, c))`` when ``n`` is ``op(x, c)`` or ``op(c, x)`` with ``c`` a one-element
    float constant (operand order kept: ``c - x`` is not ``x - c``)."""
    if len(n.src) != 2:
        return None
    a, b = n.src
    for i, (x, c) in enumerate(((a, b), (b, a))):
        if c.op is Op.CONST and c.dtype.is_float and np.asarray(c.attrs.value).size == 1 \
                and dequant_of(x) is not None:
            value = torch.from_numpy(np.asarray(c.attrs.value).reshape(()).copy())
            if i == 0:
                return x, lambda v, f=fn, k=value: f(v, k)
            return x, lambda v, f=fn, k=value: f(k, v)
    return None


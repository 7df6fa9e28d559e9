r"""int8-layer-norm

    dequant(x_q)   gamma  beta               x_q
          \          |    /                   |
        layer_norm(last axis, eps)   ==>   QLAYERNORM(zp_x, E, G = gamma/s_out, B = beta/s_out)
                  |                           -> int8 (or f32 where nothing quantizes it)
          quant(qp_out) or a float reader

    x (f32) -> layer_norm -> ...     ==>   QLAYERNORM(x f32; code_bits, k_max, e, e_shift, G, B)

A layer norm over int8 codes needs only integers: the row's sum and sum of squares (i64), one
integer square root and one divide per row, then a fixed-point multiply-add per element
(``qcompile.ir.qmath``). The residual stream of a post-LN transformer then stays int8 from one
block's residual add to the next block's projections. It differs from PT2E's float layer norm by
at most one output step, and only near rounding ties. A layer norm whose result stays float (a
model's last) is computed the same way with 24 fraction bits and converted once, so every target
returns the same float.

A layer norm that reads float (a residual stream kept float, an input) runs in integers too: each
row becomes codes of its own power-of-two scale (layer norm does not change when its row is
scaled), then the same steps (``qmath.layernorm_fixed_float``). Its result is within 2^-16 of
the float layer norm's relative to the row's largest value, and the same bit for bit on every
target, where a float layer norm's reductions round differently on each.
"""

from __future__ import annotations

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op, node
from qcompile.ir.types import DType
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer


class Int8LayerNorm(RewritePass):
    name = "int8-layer-norm"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        inner = quantized_producer(n, ctx, frozenset({Op.LAYER_NORM}))
        if inner is not None:
            out = n.attrs.qp
            # int8 out: the quantize's location, so its codes are compared with PT2E's
            return _qlayernorm(inner, n.dtype, out.s, n.loc, zp=int(out.zero_point[0]),
                               range=(int(out.qmin), int(out.qmax)))
        if n.op is Op.LAYER_NORM and not _feeds_one_quant(n, ctx):
            return _qlayernorm(n, DType.F32, 1.0, n.loc)
        return None


def _feeds_one_quant(n: Node, ctx: Context) -> bool:
    """``n``'s only reader quantizes it: the int8 rewrite's case, rooted at that quantize."""
    users = ctx.users(n)
    return len(users) == 1 and quantized_producer(users[0], ctx) is n


def _qlayernorm(ln: Node, dtype: DType, out_scale: float, loc: str,
                **out: object) -> Node | None:
    x = ln.src[0]
    x_qp = dequant_of(x)
    affine = _affine(ln)
    if len(ln.attrs.normalized_shape) != 1 or affine is None:
        return None
    if x_qp is not None and x_qp.per_tensor:
        params = qmath.layernorm_params(x_qp, ln.shape[-1], ln.attrs.eps, *affine, out_scale)
        if params is not None:
            e, g, b, sh = params
            return node(Op.QLAYERNORM, dtype, ln.shape, x.src[0], x_zp=int(x_qp.zero_point[0]),
                        e=e, g=g, b=b, sh=sh, loc=loc, **out)
    if x.dtype is not DType.F32:
        return None
    fparams = qmath.layernorm_float_params(ln.shape[-1], ln.attrs.eps, *affine, out_scale)
    if fparams is None:
        return None            # rows too long or parameters too large for exact i64 arithmetic
    code_bits, k_max, e, e_shift, g, b, sh = fparams
    return node(Op.QLAYERNORM, dtype, ln.shape, x, code_bits=code_bits, k_max=k_max, e=e,
                e_shift=e_shift, g=g, b=b, sh=sh, loc=loc, **out)


def _affine(ln: Node) -> tuple[np.ndarray, np.ndarray] | None:
    """``(gamma, beta)`` of a layer norm whose affine parameters are constants (ones and zeros
    without them); ``None`` when they are computed."""
    width = ln.shape[-1]
    if not ln.attrs.affine:
        return np.ones(width), np.zeros(width)
    w, b = ln.src[1], ln.src[2]
    if w.op is not Op.CONST or b.op is not Op.CONST:
        return None
    return (np.broadcast_to(np.asarray(w.attrs.value, np.float64), (width,)),
            np.broadcast_to(np.asarray(b.attrs.value, np.float64), (width,)))

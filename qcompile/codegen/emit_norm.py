"""The int8 layer norm (``QLAYERNORM``) in integers, as :func:`qcompile.ir.qmath.layernorm_codes`
defines it: two i64 row reductions (sum and sum of squares of the centred codes), one row-wise
generic for the integer square root and the reciprocal, one elementwise generic for the
normalised value and the fixed-point affine map (then rounded to int8, or converted to f32).
Only the result and the per-row scalars are written.

The integer square root starts from a float32 estimate (IREE's GPU targets do not all have
float64) and is made exact as ``qmath.LN_ISQRT_MARGIN`` explains."""

from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, math

from qcompile.codegen import builder as b
from qcompile.codegen.emit_softmax import reduce_last_int
from qcompile.codegen.mlir_emit import Emitter, Value, emits, materialize
from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType


def isqrt_i64(v: ir.Value) -> ir.Value:
    """``floor(sqrt(v))`` of an i64 ``v`` in ``[2^16, 2^53)``. Newton's integer step from above
    never undershoots ``isqrt`` and cuts an excess ``e`` to ``e^2 / 2r``. ``v`` is below 2^16
    only on a row of equal codes (``V = 0``, ``v = E``), where every ``n*c - S1`` is 0: its
    root, whatever it is, is never seen in the output."""
    i64 = b.int_type(64)
    estimate = math.sqrt(arith.sitofp(ir.F32Type.get(), v))
    r = arith.addi(arith.fptosi(i64, estimate), b.ci(qmath.LN_ISQRT_MARGIN, 64))
    for _ in range(qmath.LN_NEWTON_STEPS):
        r = arith.shrsi(arith.addi(r, arith.divsi(v, r)), b.ci(1, 64))
    over = arith.cmpi(arith.CmpIPredicate.sgt, arith.muli(r, r), v)
    r = arith.select(over, arith.subi(r, b.ci(1, 64)), r)
    return arith.maxsi(r, b.ci(1, 64))


@emits(Op.QLAYERNORM)
def _qlayernorm(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    a = n.attrs
    width = x.shape[-1]

    def centred(c: ir.Value) -> ir.Value:
        return arith.subi(b.widen(c, x.dtype, 64), b.ci(a.x_zp, 64))

    s1 = reduce_last_int([x], DType.I64, 0, lambda c, acc: arith.addi(acc, centred(c)))
    s2 = reduce_last_int([x], DType.I64, 0,
                      lambda c, acc: arith.addi(acc, arith.muli(centred(c), centred(c))))

    def reciprocal(t1: ir.Value, t2: ir.Value, _o: ir.Value) -> ir.Value:
        var = arith.subi(arith.muli(t2, b.ci(width, 64)), arith.muli(t1, t1))
        root = isqrt_i64(arith.addi(arith.shli(var, b.ci(qmath.LN_ROOT_SHIFT, 64)),
                                    b.ci(a.e, 64)))
        half = arith.shrsi(root, b.ci(1, 64))
        return arith.divsi(arith.addi(b.ci(1 << qmath.LN_R_BITS, 64), half), root)

    recip = b.elementwise([s1, s2], s1.shape, DType.I64, reciprocal)
    tables = [b.constant(t, DType.I64) for t in (a.g, a.b)]
    if n.dtype is DType.F32:
        tables.append(b.constant(np.ldexp(np.float32(1.0), -a.sh).astype(np.float32),
                                 DType.F32))
    else:
        tables.append(b.constant(a.sh, DType.I64))

    def out(c: ir.Value, t1: ir.Value, r: ir.Value, g: ir.Value, bias: ir.Value,
            scale: ir.Value, _o: ir.Value) -> ir.Value:
        d = arith.subi(arith.muli(centred(c), b.ci(width, 64)), t1)
        z = arith.shrsi(arith.addi(arith.muli(d, r), b.ci(1 << (qmath.LN_Z_SHIFT - 1), 64)),
                        b.ci(qmath.LN_Z_SHIFT, 64))
        t = arith.addi(arith.muli(z, g), bias)
        if n.dtype is DType.F32:       # scale = 2^-SH: float32(t) * scale, both exact roundings
            return arith.mulf(arith.sitofp(ir.F32Type.get(), t), scale)
        half = arith.shli(b.ci(1, 64), arith.subi(scale, b.ci(1, 64)))
        y = arith.shrsi(arith.addi(t, half), scale)
        q = b.clamp_int(arith.addi(y, b.ci(a.zp, 64)), *a.range, 64)
        return arith.trunci(b.int_type(8), q)

    return b.elementwise([x, s1, recip, *tables], x.shape, n.dtype, out)

"""The int8 layer norm (``QLAYERNORM``) in integers, as :func:`qcompile.ir.qmath.layernorm_codes`
defines it: two i64 row reductions (sum and sum of squares of the centred codes), one row-wise
generic for the integer square root and the reciprocal, one elementwise generic for the
normalised value and the fixed-point affine map (then rounded to int8, or converted to f32).
Only the result and the per-row scalars are written.

On a float32 input (``qmath.layernorm_fixed_float``) a row max of ``|x|`` and an elementwise
generic first turn each row into codes of its power-of-two scale (bit operations on the max's
exponent, an exact multiply, round half to even), and the row's eps term comes from the same
exponent; the rest is the same.

The integer square root starts from a float32 estimate (IREE's GPU targets do not all have
float64) and is made exact as ``qmath.LN_ISQRT_MARGIN`` explains."""

from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, math

from qcompile.codegen import builder as b
from qcompile.codegen.builder import TV
from qcompile.codegen.emit_float import reduce_last
from qcompile.codegen.emit_softmax import reduce_last_int
from qcompile.codegen.mlir_emit import Emitter, Value, emits, materialize
from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType


def isqrt_i64(v: ir.Value) -> ir.Value:
    """``floor(sqrt(v))`` of an i64 ``v`` in ``[0, 2^53)``. Newton's integer step from above
    never undershoots ``isqrt`` and cuts an excess ``e`` to ``e^2 / 2r``. Below 2^16 the float32
    root is exact to within one (``v`` is exact in float32), so the margin there is 1. A row of
    equal values with eps 0 has ``v = 0``; every step stays at 1 or more there."""
    i64 = b.int_type(64)
    estimate = arith.fptosi(i64, math.sqrt(arith.sitofp(ir.F32Type.get(), v)))
    small = arith.cmpi(arith.CmpIPredicate.slt, v, b.ci(1 << 16, 64))
    r = arith.addi(estimate, arith.select(small, b.ci(1, 64), b.ci(qmath.LN_ISQRT_MARGIN, 64)))
    for _ in range(qmath.LN_NEWTON_STEPS):   # at least 1: v = 0 would divide by zero next
        r = arith.maxsi(arith.shrsi(arith.addi(r, arith.divsi(v, r)), b.ci(1, 64)),
                        b.ci(1, 64))
    over = arith.cmpi(arith.CmpIPredicate.sgt, arith.muli(r, r), v)
    r = arith.select(over, arith.subi(r, b.ci(1, 64)), r)
    return arith.maxsi(r, b.ci(1, 64))


@emits(Op.QLAYERNORM)
def _qlayernorm(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    a = n.attrs
    width = x.shape[-1]
    root_shift, r_bits, z_shift = qmath.layernorm_shifts(x.dtype is DType.F32)
    row_eps: TV | None = None
    zp = 0
    if x.dtype is DType.F32:
        x, row_eps = _float_codes(x, a.code_bits, a.k_max, a.e, a.e_shift)
    else:
        zp = a.x_zp

    def centred(c: ir.Value) -> ir.Value:
        return arith.subi(b.widen(c, x.dtype, 64), b.ci(zp, 64))

    s1 = reduce_last_int([x], DType.I64, 0, lambda c, acc: arith.addi(acc, centred(c)))
    s2 = reduce_last_int([x], DType.I64, 0,
                      lambda c, acc: arith.addi(acc, arith.muli(centred(c), centred(c))))

    def reciprocal(t1: ir.Value, t2: ir.Value, *rest: ir.Value) -> ir.Value:
        eps = rest[0] if row_eps is not None else b.ci(a.e, 64)
        var = arith.subi(arith.muli(t2, b.ci(width, 64)), arith.muli(t1, t1))
        root = isqrt_i64(arith.addi(arith.shli(var, b.ci(root_shift, 64)), eps))
        half = arith.shrsi(root, b.ci(1, 64))
        return arith.divsi(arith.addi(b.ci(1 << r_bits, 64), half), root)

    recip = b.elementwise([s1, s2, *([row_eps] if row_eps is not None else [])], s1.shape,
                          DType.I64, reciprocal)
    tables = [b.constant(t, DType.I64) for t in (a.g, a.b)]
    if n.dtype is DType.F32:
        tables.append(b.constant(np.ldexp(np.float32(1.0), -a.sh).astype(np.float32),
                                 DType.F32))
    else:
        tables.append(b.constant(a.sh, DType.I64))

    def out(c: ir.Value, t1: ir.Value, r: ir.Value, g: ir.Value, bias: ir.Value,
            scale: ir.Value, _o: ir.Value) -> ir.Value:
        d = arith.subi(arith.muli(centred(c), b.ci(width, 64)), t1)
        z = arith.shrsi(arith.addi(arith.muli(d, r), b.ci(1 << (z_shift - 1), 64)),
                        b.ci(z_shift, 64))
        t = arith.addi(arith.muli(z, g), bias)
        if n.dtype is DType.F32:       # scale = 2^-SH: float32(t) * scale, both exact roundings
            return arith.mulf(arith.sitofp(ir.F32Type.get(), t), scale)
        half = arith.shli(b.ci(1, 64), arith.subi(scale, b.ci(1, 64)))
        y = arith.shrsi(arith.addi(t, half), scale)
        q = b.clamp_int(arith.addi(y, b.ci(a.zp, 64)), *a.range, 64)
        return arith.trunci(b.int_type(8), q)

    return b.elementwise([x, s1, recip, *tables], x.shape, n.dtype, out)


def _float_codes(x: TV, code_bits: int, k_max: int, e: int, e_shift: int) -> tuple[TV, TV]:
    """``(c, E_row)`` of :func:`qmath.layernorm_float_codes` and :func:`qmath.layernorm_row_eps`:
    i32 codes (``|c| <= 2^26``) and one i64 eps term per row."""
    f32, i32, i64 = ir.F32Type.get(), b.int_type(32), b.int_type(64)
    m = reduce_last(x, arith.maximumf, 0.0, pre=math.absf)

    def row_k(mx: ir.Value, _o: ir.Value) -> ir.Value:
        exponent = arith.andi(arith.shrui(arith.bitcast(i32, mx), b.ci(23, 32)), b.ci(255, 32))
        return arith.minsi(arith.subi(b.ci(code_bits + 126, 32), exponent), b.ci(k_max, 32))

    k = b.elementwise([m], m.shape, DType.I32, row_k)

    def code(xv: ir.Value, kv: ir.Value, _o: ir.Value) -> ir.Value:
        power = arith.bitcast(f32, arith.shli(arith.addi(kv, b.ci(127, 32)), b.ci(23, 32)))
        return arith.fptosi(i32, math.roundeven(arith.mulf(xv, power)))

    def eps(kv: ir.Value, _o: ir.Value) -> ir.Value:
        d = arith.subi(arith.shli(arith.extsi(i64, kv), b.ci(1, 64)), b.ci(e_shift, 64))
        zero = b.ci(0, 64)
        up = arith.shli(b.ci(e, 64), arith.maxsi(d, zero))
        down = arith.shrsi(b.ci(e, 64), arith.minsi(arith.subi(zero, d), b.ci(63, 64)))
        return arith.select(arith.cmpi(arith.CmpIPredicate.sge, d, zero), up, down)

    return (b.elementwise([x, k], x.shape, DType.I32, code),
            b.elementwise([k], k.shape, DType.I64, eps))

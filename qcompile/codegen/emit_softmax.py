"""The int8 softmax (``QSOFTMAX``) in integers, as :func:`qcompile.ir.qmath.softmax_codes` defines
it: a max reduction over the row's codes, an i64 sum of exp-table entries, then one elementwise
generic that looks each entry up again and divides. Three generics that IREE fuses into one or
two dispatches; nothing but int8 is written out except the row max and sum."""

from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith

from qcompile.codegen import builder as b
from qcompile.codegen.builder import TV
from qcompile.codegen.mlir_emit import Emitter, Value, emits, materialize
from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType


def reduce_last_int(ops: list[TV], dtype: DType, init: int, body) -> TV:  # type: ignore[no-untyped-def]
    """Reduce the last dim of ``ops[0]``'s shape (keepdim); ``ops[1:]`` are row-shaped."""
    x = ops[0]
    r = len(x.shape)
    out = (*x.shape[:-1], 1)
    d = b.dims(r)
    row = b.amap(r, [*d[:-1], 0])
    maps = [b.identity(r)] + [row] * (len(ops) - 1) + [row]
    res = b.generic([o.value for o in ops], [o.dtype for o in ops], out, [dtype], maps,
                    ["parallel"] * (r - 1) + ["reduction"], body,
                    inits=[b.filled(out, dtype, b.ci(init, 64 if dtype is DType.I64 else 32))])
    return TV(res[0], dtype, out)


@emits(Op.QSOFTMAX)
def _qsoftmax(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    a = n.attrs
    last = len(n.shape) - 1
    perm = None
    if a.axis != last:                        # the row axis last, and back at the end
        perm = [i for i in range(len(n.shape)) if i != a.axis] + [a.axis]
        x = b.transpose(x, perm)
    table = b.constant(a.table, DType.I64)
    lo = x.dtype.range[0]

    def entry(code: ir.Value, row_max: ir.Value) -> ir.Value:
        dist = arith.subi(row_max, b.widen(code, x.dtype, 32))
        return b.extract(table, arith.index_cast(ir.IndexType.get(), dist))

    mx = reduce_last_int([x], DType.I32, lo,
                      lambda c, acc: arith.maxsi(acc, b.widen(c, x.dtype, 32)))
    total = reduce_last_int([x, mx], DType.I64, 0,
                         lambda c, m, acc: arith.addi(acc, entry(c, m)))
    k = qmath.SOFTMAX_OUT_SHIFT

    def out(c: ir.Value, m: ir.Value, t: ir.Value, _o: ir.Value) -> ir.Value:
        num = arith.addi(arith.muli(entry(c, m), b.ci(2 * a.m, 64)),
                         arith.shli(t, b.ci(k, 64)))
        q = arith.addi(arith.divsi(num, arith.shli(t, b.ci(k + 1, 64))), b.ci(a.zp, 64))
        return arith.trunci(b.int_type(8), b.clamp_int(q, *a.range, 64))

    y = b.elementwise([x, mx, total], x.shape, n.dtype, out)
    if perm is not None:
        y = b.transpose(y, [perm.index(i) for i in range(len(perm))])
    return y

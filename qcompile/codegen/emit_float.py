"""Emitters of the explicit float fallbacks the integer-only gate leaves (``fallback=<reason>``):
elementwise math, reductions, float matmuls, softmax, layer_norm, embedding lookups.

Float results are computed in f32 like PyTorch, but reductions may sum in another order and
transcendental functions use MLIR's ``math`` approximations: float islands are close to the
reference, not bit-identical (``exactness.vs_reference`` reports what differs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, math

from qcompile.codegen import builder as b
from qcompile.codegen.builder import TV
from qcompile.codegen.mlir_emit import Emitter, Value, emits, materialize, unsupported
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType

F32 = DType.F32


def _f32(x: TV, n: Node) -> TV:
    if x.dtype is F32:
        return x
    if x.dtype in (DType.I32, DType.I64, DType.I8, DType.U8, DType.BOOL):
        return b.elementwise([x], x.shape, F32, lambda a, _o: arith.sitofp(
            ir.F32Type.get(), b.widen(a, x.dtype, 32 if x.dtype is not DType.I64 else 64)))
    raise unsupported(n, f"operand dtype {x.dtype.value}")


_BINARY: dict[Op, Callable[[ir.Value, ir.Value], ir.Value]] = {
    Op.ADD: arith.addf, Op.SUB: arith.subf, Op.MUL: arith.mulf, Op.DIV: arith.divf,
}


@emits(*_BINARY)
def _binary(em: Emitter, n: Node, v: list[Value]) -> Value:
    if n.dtype is not F32 or len(v) != 2:
        raise unsupported(n, "only f32 binary ops of two tensors have a CPU lowering")
    x, y = (_f32(materialize(t), n) for t in v)
    fn = _BINARY[n.op]
    return b.elementwise([x, y], n.shape, F32, lambda p, q, _o: fn(p, q))


def _sigmoid(a: ir.Value) -> ir.Value:
    one = b.cf(1.0)
    return arith.divf(one, arith.addf(one, math.exp(arith.negf(a))))


def _gelu(n: Node) -> Callable[[ir.Value], ir.Value]:
    if n.attrs.get("approximate", "none") == "tanh":
        def tanh_gelu(a: ir.Value) -> ir.Value:
            inner = arith.mulf(b.cf(float(np.sqrt(2.0 / np.pi))), arith.addf(
                a, arith.mulf(b.cf(0.044715), arith.mulf(a, arith.mulf(a, a)))))
            return arith.mulf(arith.mulf(b.cf(0.5), a), arith.addf(b.cf(1.0), math.tanh(inner)))
        return tanh_gelu
    return lambda a: arith.mulf(arith.mulf(b.cf(0.5), a), arith.addf(
        b.cf(1.0), math.erf(arith.mulf(a, b.cf(float(1 / np.sqrt(2.0)))))))


def _clamp(n: Node) -> Callable[[ir.Value], ir.Value]:
    lo, hi = n.attrs.get("lo"), n.attrs.get("hi")

    def fn(a: ir.Value) -> ir.Value:
        if lo is not None:
            a = arith.maximumf(a, b.cf(lo))
        if hi is not None:
            a = arith.minimumf(a, b.cf(hi))
        return a
    return fn


def _hardswish(a: ir.Value) -> ir.Value:
    r6 = arith.minimumf(arith.maximumf(arith.addf(a, b.cf(3.0)), b.cf(0.0)), b.cf(6.0))
    return arith.divf(arith.mulf(a, r6), b.cf(6.0))


def _unary_fn(n: Node) -> Callable[[ir.Value], ir.Value]:
    table: dict[Op, Callable[[ir.Value], ir.Value]] = {
        Op.RELU: lambda a: arith.maximumf(a, b.cf(0.0)),
        Op.SIGMOID: _sigmoid, Op.TANH: math.tanh, Op.HARDSWISH: _hardswish,
        Op.SILU: lambda a: arith.mulf(a, _sigmoid(a)),
    }
    if n.op is Op.GELU:
        return _gelu(n)
    if n.op is Op.CLAMP:
        return _clamp(n)
    return table[n.op]


@emits(Op.RELU, Op.SIGMOID, Op.TANH, Op.HARDSWISH, Op.SILU, Op.GELU, Op.CLAMP)
def _unary(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = _f32(materialize(v[0]), n)
    fn = _unary_fn(n)
    return b.elementwise([x], n.shape, F32, lambda a, _o: fn(a))


def reduce_last(x: TV, combine: Callable[[ir.Value, ir.Value], ir.Value], init: float,
                pre: Callable[..., ir.Value] | None = None, extra: list[TV] | None = None) -> TV:
    """Reduce the last dim of ``x`` (keepdim), ``pre(x_elem, *extra_elems)`` first."""
    r = len(x.shape)
    out = (*x.shape[:-1], 1)
    d = b.dims(r)
    red_map = b.amap(r, [*d[:-1], 0])
    ops = [x, *(extra or [])]
    maps = [b.identity(r)] + [red_map] * len(extra or []) + [red_map]
    res = b.generic([o.value for o in ops], [o.dtype for o in ops], out, [F32], maps,
                    ["parallel"] * (r - 1) + ["reduction"],
                    lambda *args: combine(args[-1], pre(*args[:-1]) if pre else args[0]),
                    inits=[b.filled(out, F32, b.cf(init))])
    return TV(res[0], F32, out)


@emits(Op.MEAN)
def _mean(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = _f32(materialize(v[0]), n)
    red = {d % len(x.shape) for d in n.attrs.dims}
    d = b.dims(len(x.shape))
    o_exprs = [d[i] if i not in red else 0 for i in range(len(x.shape))]
    if not n.attrs.keepdim:
        o_exprs = [d[i] for i in range(len(x.shape)) if i not in red]
    count = float(np.prod([x.shape[i] for i in red]))
    res = b.generic([x.value], [F32], n.shape, [F32],
                    [b.identity(len(x.shape)), b.amap(len(x.shape), o_exprs)],
                    ["reduction" if i in red else "parallel" for i in range(len(x.shape))],
                    lambda a, acc: arith.addf(acc, a), inits=[b.filled(n.shape, F32,
                                                                       b.cf(0.0))])
    total = TV(res[0], F32, n.shape)
    return b.elementwise([total], n.shape, F32, lambda a, _o: arith.divf(a, b.cf(count)))


@emits(Op.SOFTMAX)
def _softmax(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = _f32(materialize(v[0]), n)
    if n.attrs.axis % len(x.shape) != len(x.shape) - 1:
        raise unsupported(n, "softmax over a dimension other than the last")
    mx = reduce_last(x, arith.maximumf, float("-inf"))
    e = b.elementwise([x, mx], x.shape, F32, lambda a, m, _o: math.exp(arith.subf(a, m)))
    s = reduce_last(e, arith.addf, 0.0)
    return b.elementwise([e, s], x.shape, F32, lambda a, t, _o: arith.divf(a, t))


@emits(Op.LAYER_NORM)
def _layer_norm(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = _f32(materialize(v[0]), n)
    if len(n.attrs.normalized_shape) != 1:
        raise unsupported(n, "layer_norm over more than the last dimension")
    k = float(x.shape[-1])
    mean = b.elementwise([reduce_last(x, arith.addf, 0.0)], (*x.shape[:-1], 1), F32,
                         lambda a, _o: arith.divf(a, b.cf(k)))
    var = reduce_last(x, arith.addf, 0.0,
                      pre=lambda a, m: arith.mulf(arith.subf(a, m), arith.subf(a, m)),
                      extra=[mean])
    rstd = b.elementwise([var], var.shape, F32, lambda a, _o: math.rsqrt(
        arith.addf(arith.divf(a, b.cf(k)), b.cf(n.attrs.eps))))
    ops = [x, mean, rstd]
    if n.attrs.affine:
        ops += [materialize(v[1]), materialize(v[2])]

    def body(*args: ir.Value) -> ir.Value:
        y = arith.mulf(arith.subf(args[0], args[1]), args[2])
        if n.attrs.affine:
            y = arith.addf(arith.mulf(y, args[3]), args[4])
        return y

    return b.elementwise(ops, x.shape, F32, body)


def _float_matmul(x: TV, y: TV, out: tuple[int, ...], transpose_b: bool) -> TV:
    nd = len(out) + 1
    d = b.dims(nd)
    m, nn, k = d[len(out) - 2], d[len(out) - 1], d[len(out)]
    from qcompile.codegen.emit_contract import _batch_map

    y_tail = [nn, k] if transpose_b else [k, nn]
    maps = [_batch_map(x.shape, out, d, [m, k]), _batch_map(y.shape, out, d, y_tail),
            b.amap(nd, d[:len(out)])]
    res = b.generic([x.value, y.value], [F32, F32], out, [F32], maps,
                    ["parallel"] * len(out) + ["reduction"],
                    lambda p, q, acc: arith.addf(acc, arith.mulf(p, q)),
                    inits=[b.filled(out, F32, b.cf(0.0))])
    return TV(res[0], F32, out)


@emits(Op.MATMUL)
def _matmul(em: Emitter, n: Node, v: list[Value]) -> Value:
    x, y = (_f32(materialize(t), n) for t in v)
    if len(x.shape) < 2 or len(y.shape) < 2:
        raise unsupported(n, "matmul of a vector")
    return _float_matmul(x, y, n.shape, transpose_b=False)


@emits(Op.LINEAR)
def _linear(em: Emitter, n: Node, v: list[Value]) -> Value:
    x, w = (_f32(materialize(t), n) for t in v[:2])
    rows = b.reshape(x, (int(np.prod(x.shape[:-1])), x.shape[-1]))
    out = _float_matmul(rows, w, (rows.shape[0], w.shape[0]), transpose_b=True)
    if len(v) > 2:
        bias = _f32(materialize(v[2]), n)
        out = b.elementwise([out, bias], out.shape, F32, lambda p, q, _o: arith.addf(p, q))
    return b.reshape(out, n.shape)


@emits(Op.EMBEDDING)
def _embedding(em: Emitter, n: Node, v: list[Value]) -> Value:
    table, ids = materialize(v[0]), materialize(v[1])
    r = len(n.shape)

    def body(i: ir.Value, _o: ir.Value) -> ir.Value:
        row = arith.index_cast(ir.IndexType.get(), i)
        from iree.compiler.dialects import tensor

        return tensor.ExtractOp(table.value, [row, b.channel_index(r - 1)]).result

    d = b.dims(r)
    res = b.generic([ids.value], [ids.dtype], n.shape, [table.dtype],
                    [b.amap(r, d[:-1]), b.identity(r)], ["parallel"] * r, body)
    return TV(res[0], table.dtype, n.shape)


@emits(Op.AVGPOOL2D)
def _avgpool(em: Emitter, n: Node, v: list[Value]) -> Value:
    from qcompile.codegen.emit_contract import pool

    x = _f32(materialize(v[0]), n)
    div = b.cf(float(n.attrs.divisor))
    return pool(em, n, x, b.cf(0.0), F32, arith.addf, post=lambda t: arith.divf(t, div))


# -- aten ops with no QIR op (FLOAT_OP): the few the zoo's transformers export ---------------

_SHAPE_ONLY = frozenset({"aten.zeros_like.default", "aten.ones_like.default",
                         "aten.full_like.default", "aten.arange.default",
                         "aten.arange.start", "aten.zeros.default", "aten.ones.default",
                         "aten.full.default"})


def _fold(n: Node) -> TV:
    """An op whose value depends on shapes only: computed now, emitted as a constant."""
    from qcompile.reference.interpreter import execute

    dummies = [np.zeros(s.shape, dtype=s.dtype.np) for s in n.src]
    return b.constant(np.asarray(execute(n, dummies)), n.dtype)


def _cast(x: TV, out: DType, n: Node) -> TV:
    if x.dtype is out:
        return x
    if out is F32:
        return _f32(x, n)
    if x.dtype is F32 and out in (DType.I32, DType.I64):
        bits = 32 if out is DType.I32 else 64
        return b.elementwise([x], x.shape, out, lambda a, _o: arith.fptosi(b.int_type(bits), a))
    if not x.dtype.is_float and not out.is_float:
        bits = {DType.I32: 32, DType.I64: 64, DType.I8: 8, DType.U8: 8}.get(out)
        if bits:
            return b.elementwise([x], x.shape, out, lambda a, _o: b.widen(a, x.dtype, bits))
    raise unsupported(n, f"cast {x.dtype.value} -> {out.value}")


@emits(Op.FLOAT_OP)
def _float_op(em: Emitter, n: Node, v: list[Value]) -> Value:
    target, args = n.attrs.target, n.attrs.args
    if target in _SHAPE_ONLY:
        return _fold(n)
    x = materialize(v[0]) if v else None
    if target in ("aten.to.dtype", "aten._to_copy.default") and x is not None:
        return _cast(x, n.dtype, n)
    if target == "aten.rsub.Scalar" and x is not None and len(args) >= 2:
        alpha = float(args[2]) if len(args) > 2 else 1.0
        other = float(args[1])
        xf = _f32(x, n)
        return b.elementwise([xf], n.shape, F32, lambda a, _o: arith.subf(
            b.cf(other), arith.mulf(a, b.cf(alpha))))
    if target == "aten.sum.dim_IntList" and x is not None and len(args) >= 2:
        keep = bool(args[2]) if len(args) > 2 else False
        red = {d % len(x.shape) for d in args[1]}
        d = b.dims(len(x.shape))
        o_exprs = [d[i] if i not in red else 0 for i in range(len(x.shape))] if keep else \
            [d[i] for i in range(len(x.shape)) if i not in red]
        xf = _f32(x, n)
        res = b.generic([xf.value], [F32], n.shape, [F32],
                        [b.identity(len(x.shape)), b.amap(len(x.shape), o_exprs)],
                        ["reduction" if i in red else "parallel" for i in range(len(x.shape))],
                        lambda a, acc: arith.addf(acc, a),
                        inits=[b.filled(n.shape, F32, b.cf(0.0))])
        return TV(res[0], F32, n.shape)
    raise unsupported(n, f"aten op {target} has no CPU lowering")

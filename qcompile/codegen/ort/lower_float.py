"""ONNX lowerings of the float fallback ops QIR keeps (float islands): the same functions in
float32, so they agree with the reference to float rounding, not bit for bit."""

from __future__ import annotations

import math

import numpy as np

from qcompile.codegen.ort.export import Exporter, conv_attrs, lowers
from qcompile.ir.graph import Node, Op

_SIMPLE = {Op.RELU: "Relu", Op.SIGMOID: "Sigmoid", Op.TANH: "Tanh", Op.MATMUL: "MatMul",
           Op.ADD: "Add", Op.SUB: "Sub", Op.MUL: "Mul", Op.DIV: "Div"}


def _same_dtype(ex: Exporter, n: Node, v: list[str]) -> list[str]:
    """torch promotes mixed operands to the result dtype; ONNX wants them equal."""
    return [x if s.dtype is n.dtype else ex.cast(x, n.dtype) for x, s in zip(v, n.src,
                                                                             strict=True)]


@lowers(*_SIMPLE)
def _simple(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op(_SIMPLE[n.op], _same_dtype(ex, n, v))


@lowers(Op.CLAMP)
def _clamp(ex: Exporter, n: Node, v: list[str]) -> str:
    lo, hi = n.attrs.lo, n.attrs.hi
    return ex.op("Clip", [v[0], "" if lo is None else ex.const(lo, np.float32),
                          "" if hi is None else ex.const(hi, np.float32)])


@lowers(Op.HARDSWISH)
def _hardswish(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("HardSwish", v)


@lowers(Op.SILU)
def _silu(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Mul", [v[0], ex.op("Sigmoid", v)])


@lowers(Op.GELU)
def _gelu(ex: Exporter, n: Node, v: list[str]) -> str:
    x = v[0]
    half = ex.op("Mul", [x, ex.const(0.5, np.float32)])
    if n.attrs.approximate == "tanh":
        cube = ex.op("Mul", [ex.op("Mul", [x, x]), x])
        inner = ex.op("Add", [x, ex.op("Mul", [cube, ex.const(0.044715, np.float32)])])
        t = ex.op("Tanh", [ex.op("Mul", [inner, ex.const(math.sqrt(2 / math.pi), np.float32)])])
    else:
        t = ex.op("Erf", [ex.op("Mul", [x, ex.const(1 / math.sqrt(2), np.float32)])])
    return ex.op("Mul", [half, ex.op("Add", [t, ex.const(1.0, np.float32)])])


@lowers(Op.CONV2D)
def _conv(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Conv", v, **conv_attrs(n))


@lowers(Op.LINEAR)
def _linear(ex: Exporter, n: Node, v: list[str]) -> str:
    w = n.src[1]
    wt = ex.const(np.ascontiguousarray(w.attrs.value.T)) if w.op is Op.CONST \
        else ex.op("Transpose", [v[1]], perm=[1, 0])
    y = ex.op("MatMul", [v[0], wt])
    return ex.op("Add", [y, v[2]]) if len(v) > 2 else y


@lowers(Op.AVGPOOL2D)
def _avgpool(ex: Exporter, n: Node, v: list[str]) -> str:
    a = n.attrs
    y = ex.op("AveragePool", v, kernel_shape=list(a.kernel), strides=list(a.stride),
              pads=[*a.padding, *a.padding], count_include_pad=1)
    window = a.kernel[0] * a.kernel[1]
    if a.divisor != window:
        y = ex.op("Mul", [y, ex.const(window / a.divisor, np.float32)])
    return y


@lowers(Op.MEAN)
def _mean(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("ReduceMean", v, axes=list(n.attrs.dims), keepdims=int(n.attrs.keepdim))


@lowers(Op.SOFTMAX)
def _softmax(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Softmax", v, axis=int(n.attrs.axis))


@lowers(Op.LAYER_NORM)
def _layer_norm(ex: Exporter, n: Node, v: list[str]) -> str:
    norm = n.attrs.normalized_shape
    if not n.attrs.affine:
        v = [v[0], ex.const(np.ones(norm, np.float32)), ex.const(np.zeros(norm, np.float32))]
    return ex.op("LayerNormalization", v, axis=-len(norm), epsilon=float(n.attrs.eps))


@lowers(Op.EMBEDDING)
def _embedding(ex: Exporter, n: Node, v: list[str]) -> str:
    ids = v[1] if n.src[1].dtype.value == "i64" else ex.op("Cast", [v[1]], to=7)
    return ex.op("Gather", [v[0], ids], axis=0)


# -- aten ops with no QIR op (FLOAT_OP): the few the zoo's transformers export (as on cpu) -----

_SHAPE_ONLY = frozenset({"aten.zeros_like.default", "aten.ones_like.default",
                         "aten.full_like.default", "aten.arange.default", "aten.arange.start",
                         "aten.zeros.default", "aten.ones.default", "aten.full.default"})


@lowers(Op.FLOAT_OP)
def _float_op(ex: Exporter, n: Node, v: list[str]) -> str:
    from qcompile.codegen.ort.export import _unsupported
    from qcompile.reference.interpreter import execute

    target, args = n.attrs.target, n.attrs.args
    if target in _SHAPE_ONLY:   # depends on shapes only: a constant
        dummies = [np.zeros(s.shape, dtype=s.dtype.np) for s in n.src]
        return ex.const(np.asarray(execute(n, dummies)).astype(n.dtype.np))
    if target in ("aten.to.dtype", "aten._to_copy.default") and v:
        return v[0] if n.src[0].dtype is n.dtype else ex.cast(v[0], n.dtype)
    if target == "aten.rsub.Scalar" and v and len(args) >= 2:
        alpha = float(args[2]) if len(args) > 2 else 1.0
        x = v[0] if n.src[0].dtype is n.dtype else ex.cast(v[0], n.dtype)
        scaled = ex.op("Mul", [x, ex.const(alpha, n.dtype.np)])
        return ex.op("Sub", [ex.const(float(args[1]), n.dtype.np), scaled])
    if target == "aten.sum.dim_IntList" and v and len(args) >= 2:
        keep = bool(args[2]) if len(args) > 2 else False
        x = v[0] if n.src[0].dtype is n.dtype else ex.cast(v[0], n.dtype)
        dims = [d % len(n.src[0].shape) for d in args[1]]
        return ex.op("ReduceSum", [x, ex.const(dims, np.int64)], keepdims=int(keep))
    raise _unsupported(n)

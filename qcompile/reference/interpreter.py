"""The reference interpreter: executes QIR exactly, with the integer semantics of
:mod:`qcompile.ir.qmath`. Compiled code on every target must equal it bit for bit.

Integer contractions are computed as float64 convolutions/matmuls of ``x - zp`` and the int8
weights: every product and partial sum is an integer below 2^53, so float64 arithmetic is exact
(whatever order BLAS sums in) and far faster than int64 loops. ``EXACT_LIMIT`` guards that bound.
Float ops run as the same torch ops PT2E runs, in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from qcompile.ir import qmath
from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType

EXACT_LIMIT = 2**53
Impl = Callable[[Node, list[np.ndarray]], np.ndarray]
_IMPLS: dict[Op, Impl] = {}


def impl(*ops: Op) -> Callable[[Impl], Impl]:
    def add(fn: Impl) -> Impl:
        for op in ops:
            _IMPLS[op] = fn
        return fn

    return add


def _t(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _exact_i32(acc: torch.Tensor, bound: float) -> np.ndarray:
    if bound >= EXACT_LIMIT:
        raise OverflowError(f"integer accumulation bound {bound:.3g} exceeds 2^53")
    out = np.rint(_np(acc)).astype(np.int64)
    info = np.iinfo(np.int32)
    if out.size and (out.min() < info.min or out.max() > info.max):
        raise OverflowError("i32 accumulator overflow")
    return out.astype(np.int32)


def _centred(x: np.ndarray, zp: int) -> torch.Tensor:
    return _t(x.astype(np.int64) - zp, torch.float64)


def _nchw(n: Node, x: np.ndarray) -> np.ndarray:
    """An NHWC operand as NCHW (torch's convolutions and pools are NCHW). The copy is made on
    the narrow integer array: float64 convolutions on channels-last strides are several times
    slower."""
    return np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2))) if _is_nhwc(n) else x


def _back(n: Node, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1))) if _is_nhwc(n) else x


def _is_nhwc(n: Node) -> bool:
    return n.attrs.get("layout") == "nhwc"


@impl(Op.QCONV2D)
def _qconv(n: Node, v: list[np.ndarray]) -> np.ndarray:
    x, w, b = v
    a = n.attrs
    xc = _centred(_nchw(n, x), a.x_zp)
    wt = _t(_nchw(n, w), torch.float64)   # nhwc: F x KH x KW x C/g -> F x C/g x KH x KW
    acc = F.conv2d(xc, wt, _t(b, torch.float64), a.stride, a.padding, a.dilation, a.groups)
    k = wt.shape[1] * wt.shape[2] * wt.shape[3]
    return _back(n, _exact_i32(acc, 256.0 * 128 * k + np.abs(b).max(initial=0)))


@impl(Op.QLINEAR)
def _qlinear(n: Node, v: list[np.ndarray]) -> np.ndarray:
    x, w, b = v
    acc = F.linear(_centred(x, n.attrs.x_zp), _t(w, torch.float64), _t(b, torch.float64))
    return _exact_i32(acc, 256.0 * 128 * w.shape[1] + np.abs(b).max(initial=0))


@impl(Op.QMATMUL)
def _qmatmul(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a, b = v
    acc = torch.matmul(_centred(a, n.attrs.a_zp), _centred(b, n.attrs.b_zp))
    return _exact_i32(acc, 256.0 * 256 * a.shape[-1])


@impl(Op.QMUL)
def _qmul(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a, b = v
    return ((a.astype(np.int64) - n.attrs.a_zp) * (b.astype(np.int64) - n.attrs.b_zp)).astype(
        np.int32)


@impl(Op.QSUMPOOL2D)
def _qsumpool(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    x = _centred(_nchw(n, v[0]), a.x_zp)
    acc = F.avg_pool2d(x, a.kernel, a.stride, a.padding, divisor_override=1)
    return _back(n, _exact_i32(acc, 256.0 * a.kernel[0] * a.kernel[1]))


@impl(Op.QSUM)
def _qsum(n: Node, v: list[np.ndarray]) -> np.ndarray:
    centred = v[0].astype(np.int64) - n.attrs.x_zp
    return np.sum(centred, axis=tuple(n.attrs.dims), keepdims=n.attrs.keepdim).astype(np.int32)


@impl(Op.REQUANT)
def _requant(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return qmath.requantize(n.attrs.rq, *v)


@impl(Op.LUT)
def _lut(n: Node, v: list[np.ndarray]) -> np.ndarray:
    lo = n.src[0].dtype.range[0]
    return n.attrs.table[v[0].astype(np.int64) - lo]


@impl(Op.QSOFTMAX)
def _qsoftmax(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    q = qmath.softmax_codes(v[0], a.axis, a.table, a.m, a.zp, a.range)
    return q.astype(n.dtype.np)


@impl(Op.QLAYERNORM)
def _qlayernorm(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    if n.src[0].dtype is DType.F32:
        t = qmath.layernorm_fixed_float(v[0], a.code_bits, a.k_max, a.e, a.e_shift, a.g, a.b)
    else:
        t = qmath.layernorm_fixed(v[0], a.x_zp, a.e, a.g, a.b)
    if n.dtype is DType.F32:
        return qmath.layernorm_float(t, a.sh)
    return qmath.layernorm_codes(t, a.sh, a.zp, a.range).astype(n.dtype.np)


@impl(Op.MASK_LUT)
def _mask_lut(n: Node, v: list[np.ndarray]) -> np.ndarray:
    x, m = v
    row = np.broadcast_to(np.clip(m.astype(np.int64), -1, 2) + 1, x.shape)
    return n.attrs.table[row, x.astype(np.int64) - n.src[0].dtype.range[0]].astype(n.dtype.np)


@impl(Op.QUANT)
def _quant(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return qmath.quantize_array(v[0], n.attrs.qp)


@impl(Op.DEQUANT)
def _dequant(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return qmath.dequantize_array(v[0], n.attrs.qp)


@impl(Op.MAXPOOL2D)
def _maxpool(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    x = _t(_nchw(n, v[0]), torch.float32)  # int8 codes are exact in float32
    out = F.max_pool2d(x, a.kernel, a.stride, a.padding, a.dilation)
    return _back(n, _np(out).astype(n.dtype.np))


@impl(Op.RESHAPE)
def _reshape(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return v[0].reshape(n.shape)


@impl(Op.PERMUTE)
def _permute(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(v[0], n.attrs.dims))


@impl(Op.CAT)
def _cat(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(v, axis=n.attrs.axis)


@impl(Op.PAD)
def _pad(n: Node, v: list[np.ndarray]) -> np.ndarray:
    pads = n.attrs.pads
    width = [(0, 0)] * v[0].ndim
    for i in range(len(pads) // 2):   # torch order: last dim first
        width[v[0].ndim - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    value = n.attrs.value
    return np.pad(v[0], width, constant_values=np.asarray(value).astype(n.dtype.np))


_FLOAT: dict[Op, Callable[..., torch.Tensor]] = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div,
    Op.RELU: torch.relu, Op.HARDSWISH: F.hardswish, Op.SILU: F.silu, Op.SIGMOID: torch.sigmoid,
    Op.TANH: torch.tanh, Op.MATMUL: torch.matmul,
}


def float_fn(n: Node) -> Callable[..., torch.Tensor]:
    """The torch function a float QIR op stands for (shared with the LUT pass)."""
    a = n.attrs
    if n.op in _FLOAT:
        return _FLOAT[n.op]
    if n.op is Op.GELU:
        return lambda x: F.gelu(x, approximate=a.approximate)
    if n.op is Op.CLAMP:
        return lambda x: torch.clamp(x, a.lo, a.hi)
    raise KeyError(n.op)


@impl(*_FLOAT, Op.GELU, Op.CLAMP)
def _float_simple(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return _np(float_fn(n)(*[_t(x, torch.from_numpy(x).dtype) for x in v]))


@impl(Op.CONV2D)
def _conv(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    bias = _t(v[2]) if len(v) > 2 else None
    return _np(F.conv2d(_t(v[0]), _t(v[1]), bias, a.stride, a.padding, a.dilation, a.groups))


@impl(Op.LINEAR)
def _linear(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return _np(F.linear(_t(v[0]), _t(v[1]), _t(v[2]) if len(v) > 2 else None))


@impl(Op.AVGPOOL2D)
def _avgpool(n: Node, v: list[np.ndarray]) -> np.ndarray:
    a = n.attrs
    return _np(F.avg_pool2d(_t(v[0]), a.kernel, a.stride, a.padding, divisor_override=a.divisor))


@impl(Op.MEAN)
def _mean(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return _np(torch.mean(_t(v[0]), dim=list(n.attrs.dims), keepdim=n.attrs.keepdim))


@impl(Op.SOFTMAX)
def _softmax(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return _np(torch.softmax(_t(v[0]), dim=n.attrs.axis))


@impl(Op.LAYER_NORM)
def _layer_norm(n: Node, v: list[np.ndarray]) -> np.ndarray:
    w, b = (_t(v[1]), _t(v[2])) if n.attrs.affine else (None, None)
    return _np(F.layer_norm(_t(v[0]), n.attrs.normalized_shape, w, b, n.attrs.eps))


@impl(Op.EMBEDDING)
def _embedding(n: Node, v: list[np.ndarray]) -> np.ndarray:
    return v[0][v[1].astype(np.int64)]


@impl(Op.FLOAT_OP)
def _float_op(n: Node, v: list[np.ndarray]) -> np.ndarray:
    target = resolve_aten(n.attrs.target)
    tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in v]

    def fill(t: Any) -> Any:
        if isinstance(t, tuple) and len(t) == 2 and t[0] == "%":
            return tensors[t[1]]
        if isinstance(t, tuple) and len(t) == 2 and t[0] == "torch":
            return getattr(torch, t[1])
        if isinstance(t, tuple) and len(t) == 2 and t[0] == "device":
            return torch.device(t[1])
        if isinstance(t, tuple):
            return [fill(x) for x in t]
        return t

    out = target(*fill(n.attrs.args), **{k: fill(x) for k, x in n.attrs.kwargs})
    return _np(out).astype(n.dtype.np, copy=False)


def resolve_aten(name: str) -> Any:
    """``'aten.sigmoid.default'`` → ``torch.ops.aten.sigmoid.default``."""
    obj: Any = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def execute(n: Node, values: list[np.ndarray]) -> np.ndarray:
    """One node on its operands' values."""
    if n.op is Op.CONST:
        return n.attrs.value
    return _IMPLS[n.op](n, values)


def run(graph: Graph, *inputs: np.ndarray, trace: dict[int, np.ndarray] | None = None
        ) -> list[np.ndarray]:
    """Execute ``graph`` on numpy inputs; ``trace`` (if given) receives every node's value."""
    values: dict[int, np.ndarray] = {}
    by_input = {id(n): x for n, x in zip(graph.inputs, inputs, strict=True)}
    for n in graph.nodes():
        if n.op is Op.INPUT:
            values[id(n)] = np.asarray(by_input[id(n)])
        elif n.op is Op.CONST:
            values[id(n)] = n.attrs.value
        else:
            values[id(n)] = _IMPLS[n.op](n, [values[id(s)] for s in n.src])
    if trace is not None:
        trace.update(values)
    return [values[id(o)] for o in graph.outputs]

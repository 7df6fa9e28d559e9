"""ONNX lowerings of QIR's integer ops, int8 data movement, quantize and dequantize (exact: see
:mod:`qcompile.codegen.ort.export`)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from qcompile.codegen.ort.export import (
    Exporter,
    back,
    conv_attrs,
    lowers,
    nchw,
    zero_point,
)
from qcompile.ir import qmath
from qcompile.ir.graph import Attrs, Node, Op
from qcompile.ir.types import DType


@lowers(Op.QCONV2D)
def _qconv(ex: Exporter, n: Node, v: list[str]) -> str:
    x, w, b = n.src
    weight = w.attrs.value if w.op is Op.CONST else None
    if weight is None:
        raise _needs_const(n, "weight")
    if n.attrs.get("layout") == "nhwc":
        weight = np.transpose(weight, TO_OIHW)
    acc = ex.op("ConvInteger", [nchw(ex, n, v[0]), ex.const(weight),
                                zero_point(ex, n.attrs.x_zp, x.dtype)], **conv_attrs(n))
    bias = ex.const(np.asarray(b.attrs.value, np.int32).reshape(1, -1, 1, 1)) \
        if b.op is Op.CONST else ex.op("Unsqueeze", [v[2], ex.const([0, 2, 3], np.int64)])
    return back(ex, n, ex.op("Add", [acc, bias]))


TO_OIHW = (0, 3, 1, 2)   # F x KH x KW x C/g -> F x C/g x KH x KW


@lowers(Op.QLINEAR)
def _qlinear(ex: Exporter, n: Node, v: list[str]) -> str:
    x, w, _ = n.src
    wt = ex.const(np.ascontiguousarray(w.attrs.value.T)) if w.op is Op.CONST \
        else ex.op("Transpose", [v[1]], perm=[1, 0])
    acc = ex.op("MatMulInteger", [v[0], wt, zero_point(ex, n.attrs.x_zp, x.dtype)])
    return ex.op("Add", [acc, v[2]])


@lowers(Op.QMATMUL)
def _qmatmul(ex: Exporter, n: Node, v: list[str]) -> str:
    a, b = n.src
    return ex.op("MatMulInteger", [v[0], v[1], zero_point(ex, n.attrs.a_zp, a.dtype),
                                   zero_point(ex, n.attrs.b_zp, b.dtype)])


def _centred(ex: Exporter, x: str, zp: int, dtype: DType = DType.I32) -> str:
    wide = ex.cast(x, dtype)
    return ex.op("Sub", [wide, ex.const(zp, dtype.np)]) if zp else wide


@lowers(Op.QMUL)
def _qmul(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Mul", [_centred(ex, v[0], n.attrs.a_zp), _centred(ex, v[1], n.attrs.b_zp)])


@lowers(Op.QSUMPOOL2D)
def _qsumpool(ex: Exporter, n: Node, v: list[str]) -> str:
    """Window sums of ``x - zp`` as a depthwise ConvInteger with all-one weights: the padding
    holds the zero point, i.e. a centred zero, as in the reference."""
    a = n.attrs
    channels = n.shape[3] if a.get("layout") == "nhwc" else n.shape[1]
    ones = np.ones((channels, 1, *a.kernel), np.uint8)
    acc = ex.op("ConvInteger", [nchw(ex, n, v[0]), ex.const(ones),
                                zero_point(ex, a.x_zp, n.src[0].dtype)],
                strides=list(a.stride), pads=[*a.padding, *a.padding], group=channels)
    return back(ex, n, acc)


@lowers(Op.QSUM)
def _qsum(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("ReduceSum", [_centred(ex, v[0], n.attrs.x_zp),
                               ex.const(list(n.attrs.dims), np.int64)],
                 keepdims=int(n.attrs.keepdim))


@lowers(Op.REQUANT)
def _requant(ex: Exporter, n: Node, v: list[str]) -> str:
    """``clamp(floor((sum_i (x_i - z_i) * M_i[c] + 2^(s-1)) / 2^s) + zp)`` in int64."""
    rq = n.attrs.rq
    ndim = max(len(s.shape) for s in n.src)
    total = None
    for x, term in zip(v, rq.terms, strict=True):
        prod = ex.op("Mul", [_centred(ex, x, term.zero_point, DType.I64),
                             ex.const(qmath.per_channel(term.multiplier, rq.axis, ndim))])
        total = prod if total is None else ex.op("Add", [total, prod])
    shifted = _round_shift(ex, total, qmath.per_channel(rq.shift, rq.axis, ndim))
    out = ex.op("Add", [shifted, ex.const(rq.zp_out, np.int64)])
    out = ex.op("Clip", [out, ex.const(rq.qmin, np.int64), ex.const(rq.qmax, np.int64)])
    return ex.cast(out, rq.out_dtype)


@lowers(Op.LUT)
def _lut(ex: Exporter, n: Node, v: list[str]) -> str:
    lo = n.src[0].dtype.range[0]
    index = ex.cast(v[0], DType.I64)
    if lo:
        index = ex.op("Sub", [index, ex.const(lo, np.int64)])
    return ex.op("Gather", [ex.const(np.asarray(n.attrs.table)), index], axis=0)


@lowers(Op.MASK_LUT)
def _mask_lut(ex: Exporter, n: Node, v: list[str]) -> str:
    """``table[(clamp(m, -1, 2) + 1) * 256 + x - lo]`` on the flattened table (Add broadcasts
    the mask onto the codes)."""
    table = np.asarray(n.attrs.table)
    row = ex.op("Clip", [ex.cast(v[1], DType.I64), ex.const(-1, np.int64), ex.const(2, np.int64)])
    row = ex.op("Mul", [ex.op("Add", [row, ex.const(1, np.int64)]),
                        ex.const(table.shape[1], np.int64)])
    code = _centred(ex, v[0], n.src[0].dtype.range[0], DType.I64)
    flat = ex.const(table.reshape(-1).astype(n.dtype.np))
    return ex.op("Gather", [flat, ex.op("Add", [row, code])], axis=0)


@lowers(Op.QSOFTMAX)
def _qsoftmax(ex: Exporter, n: Node, v: list[str]) -> str:
    """:func:`qmath.softmax_codes` in i64 ONNX ops (opset 17: ReduceMax takes its axes as an
    attribute, ReduceSum as an input); the non-negative divide truncates, i.e. floors."""
    a = n.attrs
    x = ex.cast(v[0], DType.I64)
    dist = ex.op("Sub", [ex.op("ReduceMax", [x], axes=[a.axis], keepdims=1), x])
    e = ex.op("Gather", [ex.const(np.asarray(a.table, np.int64)), dist], axis=0)
    total = ex.op("ReduceSum", [e, ex.const([a.axis], np.int64)], keepdims=1)
    k = qmath.SOFTMAX_OUT_SHIFT
    num = ex.op("Add", [ex.op("Mul", [e, ex.const(2 * a.m, np.int64)]),
                        ex.op("Mul", [total, ex.const(2**k, np.int64)])])
    q = ex.op("Div", [num, ex.op("Mul", [total, ex.const(2 ** (k + 1), np.int64)])])
    q = ex.op("Add", [q, ex.const(a.zp, np.int64)])
    q = ex.op("Clip", [q, ex.const(a.range[0], np.int64), ex.const(a.range[1], np.int64)])
    return ex.cast(q, n.dtype)


@lowers(Op.QLAYERNORM)
def _qlayernorm(ex: Exporter, n: Node, v: list[str]) -> str:
    """:func:`qmath.layernorm_codes` in i64 ONNX ops. ONNX has no arithmetic right shift on
    signed integers: ``round_half_up(v, s)`` is ``floor((v + 2^(s-1)) / 2^s)``, a floored Mod
    subtracted before the (then exact) Div; the square root is float64 Sqrt plus the exact
    integer fix-up of :func:`qmath.isqrt_rows`; the divide of two positives truncates, i.e.
    floors."""
    a = n.attrs
    i64 = DType.I64
    floating = n.src[0].dtype is DType.F32
    root_shift, r_bits, z_shift = qmath.layernorm_shifts(floating)
    if floating:
        c, eps = _float_codes(ex, v[0], a)
    else:
        c, eps = _centred(ex, v[0], a.x_zp, i64), ex.const(a.e, np.int64)
    axes = ex.const([-1], np.int64)
    s1 = ex.op("ReduceSum", [c, axes], keepdims=1)
    s2 = ex.op("ReduceSum", [ex.op("Mul", [c, c]), axes], keepdims=1)
    width = ex.const(n.shape[-1], np.int64)
    var = ex.op("Sub", [ex.op("Mul", [s2, width]), ex.op("Mul", [s1, s1])])
    arg = ex.op("Add", [ex.op("Mul", [var, ex.const(1 << root_shift, np.int64)]), eps])
    root = ex.op("Max", [_isqrt(ex, arg), ex.const(1, np.int64)])
    half = ex.op("Div", [root, ex.const(2, np.int64)])
    recip = ex.op("Div", [ex.op("Add", [ex.const(1 << r_bits, np.int64), half]), root])
    d = ex.op("Sub", [ex.op("Mul", [c, width]), s1])
    z = _round_shift(ex, ex.op("Mul", [d, recip]), np.int64(z_shift))
    y = ex.op("Add", [ex.op("Mul", [z, ex.const(np.asarray(a.g, np.int64))]),
                      ex.const(np.asarray(a.b, np.int64))])
    if n.dtype is DType.F32:       # float32(t) * 2^-SH: two exact roundings
        scale = np.ldexp(np.float32(1.0), -np.asarray(a.sh)).astype(np.float32)
        return ex.op("Mul", [ex.cast(y, DType.F32), ex.const(scale)])
    q = ex.op("Add", [_round_shift(ex, y, np.asarray(a.sh, np.int64)), ex.const(a.zp, np.int64)])
    q = ex.op("Clip", [q, ex.const(a.range[0], np.int64), ex.const(a.range[1], np.int64)])
    return ex.cast(q, n.dtype)


def _float_codes(ex: Exporter, x: str, a: Attrs) -> tuple[str, str]:
    """Codes (i64) and eps term per row of :func:`qmath.layernorm_float_codes` and
    :func:`qmath.layernorm_row_eps`. ONNX cannot bitcast: the max's exponent bits are
    ``floor(log2(max)) + 127``, a float64 log2 corrected by exact powers of two either side
    (0 for a max below 2^-126, as its exponent bits are)."""
    f64 = TensorProto.DOUBLE
    m = ex.op("Cast", [ex.op("ReduceMax", [ex.op("Abs", [x])], axes=[-1], keepdims=1)], to=f64)
    m = ex.op("Max", [m, ex.const(2.0**-200)])
    two = ex.const(2.0)
    est = ex.op("Floor", [ex.op("Div", [ex.op("Log", [m]), ex.const(np.log(2.0))])])
    est = ex.op("Sub", [est, ex.op("Cast", [ex.op("Greater", [ex.op("Pow", [two, est]), m])],
                                   to=f64)])
    est_up = ex.op("Add", [est, ex.const(1.0)])
    est = ex.op("Add", [est, ex.op("Cast", [ex.op("LessOrEqual",
                                                  [ex.op("Pow", [two, est_up]), m])], to=f64)])
    bits = ex.op("Max", [ex.op("Add", [ex.cast(est, DType.I64), ex.const(127, np.int64)]),
                         ex.const(0, np.int64)])
    k = ex.op("Min", [ex.op("Sub", [ex.const(a.code_bits + 126, np.int64), bits]),
                      ex.const(a.k_max, np.int64)])
    power = ex.op("Cast", [ex.op("Pow", [two, ex.op("Cast", [k], to=f64)])],
                  to=TensorProto.FLOAT)
    codes = ex.cast(ex.op("Round", [ex.op("Mul", [x, power])]), DType.I64)
    d = ex.op("Sub", [ex.op("Mul", [k, ex.const(2, np.int64)]), ex.const(a.e_shift, np.int64)])
    zero = ex.const(0, np.int64)
    e = ex.const(np.uint64(a.e))

    def shift(direction: str, by: str) -> str:
        amount = ex.op("Cast", [by], to=TensorProto.UINT64)
        return ex.cast(ex.op("BitShift", [e, amount], direction=direction), DType.I64)

    up = shift("LEFT", ex.op("Max", [d, zero]))
    down = shift("RIGHT", ex.op("Min", [ex.op("Neg", [d]), ex.const(63, np.int64)]))
    return codes, ex.op("Where", [ex.op("GreaterOrEqual", [d, zero]), up, down])


def _isqrt(ex: Exporter, v: str) -> str:
    """``floor(sqrt(v))`` for i64 ``0 <= v < 2^53``: float64 Sqrt is within one of it."""
    r = ex.cast(ex.op("Floor", [ex.op("Sqrt", [ex.op("Cast", [v], to=TensorProto.DOUBLE)])]),
                DType.I64)
    one = ex.const(1, np.int64)
    r = ex.op("Sub", [r, ex.cast(ex.op("Greater", [ex.op("Mul", [r, r]), v]), DType.I64)])
    up = ex.op("Add", [r, one])
    return ex.op("Add", [r, ex.cast(ex.op("LessOrEqual", [ex.op("Mul", [up, up]), v]), DType.I64)])


def _round_shift(ex: Exporter, v: str, shift: np.ndarray) -> str:
    """``(v + 2^(s-1)) >> s`` (arithmetic) as a floored division by ``2^s``."""
    biased = ex.op("Add", [v, ex.const(np.left_shift(np.int64(1), shift - 1))])
    divisor = ex.const(np.left_shift(np.int64(1), shift))
    return ex.op("Div", [ex.op("Sub", [biased, ex.op("Mod", [biased, divisor], fmod=0)]), divisor])


@lowers(Op.QUANT)
def _quant(ex: Exporter, n: Node, v: list[str]) -> str:
    """PT2E's quantize as :func:`qmath.quantize_array` computes it: times the float32
    reciprocal of the float32 scale, round half to even, plus the zero point, clamp."""
    qp = n.attrs.qp
    scale, zp = qmath.broadcast_qparams(n.attrs.qp, len(n.shape))
    inv = (np.float32(1.0) / scale.astype(np.float32)).astype(np.float32)
    x = v[0] if n.src[0].dtype is DType.F32 else ex.cast(v[0], DType.F32)
    q = ex.op("Round", [ex.op("Mul", [x, ex.const(inv)])])
    q = ex.op("Add", [q, ex.const(zp.astype(np.float32))])
    q = ex.op("Clip", [q, ex.const(qp.qmin, np.float32), ex.const(qp.qmax, np.float32)])
    return ex.cast(q, n.dtype)


@lowers(Op.DEQUANT)
def _dequant(ex: Exporter, n: Node, v: list[str]) -> str:
    """``float32((x - zp) * m) * 2^-sh``, as :func:`qmath.dequantize_array`."""
    scale, zp = qmath.broadcast_qparams(n.attrs.qp, len(n.shape))
    m, power = qmath.scale_fixed(scale)
    x = ex.cast(v[0], DType.I64)
    if np.any(zp):
        x = ex.op("Sub", [x, ex.const(zp)])
    x = ex.op("Mul", [x, ex.const(m)])
    return ex.op("Mul", [ex.cast(x, DType.F32), ex.const(power)])


@lowers(Op.MAXPOOL2D)
def _maxpool(ex: Exporter, n: Node, v: list[str]) -> str:
    a = n.attrs
    y = ex.op("MaxPool", [nchw(ex, n, v[0])], kernel_shape=list(a.kernel),
              strides=list(a.stride), pads=[*a.padding, *a.padding],
              dilations=list(a.dilation))
    return back(ex, n, y)


@lowers(Op.RESHAPE)
def _reshape(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Reshape", [v[0], ex.const(list(n.shape), np.int64)])


@lowers(Op.PERMUTE)
def _permute(ex: Exporter, n: Node, v: list[str]) -> str:
    return ex.op("Transpose", [v[0]], perm=list(n.attrs.dims))


@lowers(Op.CAT)
def _cat(ex: Exporter, n: Node, v: list[str]) -> str:
    parts = [x if s.dtype is n.dtype else ex.cast(x, n.dtype)
             for x, s in zip(v, n.src, strict=True)]
    return ex.op("Concat", parts, axis=int(n.attrs.axis))


@lowers(Op.PAD)
def _pad(ex: Exporter, n: Node, v: list[str]) -> str:
    """torch's pads (last dim first, (before, after) pairs) as ONNX's (all befores, then all
    afters); the value in the tensor's own dtype (an int8 pad holds the zero point)."""
    rank, pads = len(n.shape), n.attrs.pads
    before, after = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        before[rank - 1 - i], after[rank - 1 - i] = pads[2 * i], pads[2 * i + 1]
    value = np.asarray(n.attrs.value).astype(n.dtype.np)
    return ex.op("Pad", [v[0], ex.const(before + after, np.int64), ex.const(value)])


def _needs_const(n: Node, what: str) -> Exception:
    from qcompile.errors import UnsupportedGraphError

    return UnsupportedGraphError(
        f"ort: {n.op.value} with a computed {what}", at=n.loc or n.op.value,
        why="ConvInteger's weights are exported as initializers",
        next="run this model on target cpu or reference")

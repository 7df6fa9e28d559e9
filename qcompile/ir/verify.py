"""The QIR verifier: typing rules per op, checked after every pass.

A rule is a small function ``(node) -> problem or None``; the verifier names the first broken rule
with the node's printed line and location.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import DATA_MOVEMENT, Graph, Node, Op
from qcompile.ir.types import DType, QParams, Requant


class VerifyError(ValueError):
    pass


Rule = Callable[[Node], str | None]


def _int_src(n: Node, *idx: int) -> str | None:
    for i in idx:
        if not n.src[i].dtype.is_int8:
            return f"operand {i} must be i8/u8, is {n.src[i].dtype.value}"
    return None


def _arity(n: Node, lo: int, hi: int | None = None) -> str | None:
    hi = lo if hi is None else hi
    return None if lo <= len(n.src) <= hi else f"takes {lo}..{hi} operands, has {len(n.src)}"


def _const(n: Node) -> str | None:
    v = n.attrs.get("value")
    if not isinstance(v, np.ndarray):
        return "const needs an array 'value'"
    if tuple(v.shape) != n.shape or DType.of_numpy(v.dtype) is not n.dtype:
        return f"value is {v.dtype}{list(v.shape)}, node says {n.dtype.value}{list(n.shape)}"
    return None


def _quant(n: Node) -> str | None:
    qp = n.attrs.get("qp")
    if not isinstance(qp, QParams) or qp.dtype is not n.dtype:
        return "quant needs qp whose dtype is the result dtype"
    return None if n.src[0].dtype.is_float else "quant reads f32"


def _dequant(n: Node) -> str | None:
    if not isinstance(n.attrs.get("qp"), QParams):
        return "dequant needs qp"
    if n.src[0].dtype not in (DType.I8, DType.U8, DType.I32):
        return "dequant reads i8/u8/i32"
    return None if n.dtype.is_float else "dequant yields f32"


def _contraction(n: Node) -> str | None:
    if n.dtype is not DType.I32:
        return "integer contraction yields i32"
    if n.op in (Op.QCONV2D, Op.QLINEAR):
        w, b = n.src[1], n.src[2]
        if w.op is not Op.CONST or w.dtype is not DType.I8:
            return "weights must be an i8 const"
        if b.op is not Op.CONST or b.dtype is not DType.I32:
            return "bias must be an i32 const"
        return _int_src(n, 0)
    return _int_src(n, *range(len(n.src)))


def _requant(n: Node) -> str | None:
    rq = n.attrs.get("rq")
    if not isinstance(rq, Requant):
        return "requant needs rq"
    if len(rq.terms) != len(n.src) or rq.out_dtype is not n.dtype:
        return f"rq has {len(rq.terms)} terms for {len(n.src)} operands / wrong dtype"
    if any(s.dtype not in (DType.I8, DType.U8, DType.I32) for s in n.src):
        return "requant reads integers"
    if rq.axis is not None and n.shape[rq.axis] != rq.channels:
        return f"rq has {rq.channels} channels, axis {rq.axis} has {n.shape[rq.axis]}"
    return None


def _lut(n: Node) -> str | None:
    t = n.attrs.get("table")
    if not isinstance(t, np.ndarray) or t.shape != (256,) or DType.of_numpy(t.dtype) is not n.dtype:
        return "lut needs a 256-entry table of the result dtype"
    return _int_src(n, 0)


def _qsoftmax(n: Node) -> str | None:
    x, a = n.src[0], n.attrs
    lo, hi = x.dtype.range if x.dtype.is_int8 else (0, -1)
    t = a.get("table")
    if not isinstance(t, np.ndarray) or t.dtype != np.int64 or t.shape != (hi - lo + 1,):
        return "qsoftmax needs an i64 exp table with one entry per code distance of its input"
    if not n.dtype.is_int8 or n.shape != x.shape:
        return "qsoftmax maps int8 codes to int8 codes of the same shape"
    if not isinstance(a.get("axis"), int) or not -len(n.shape) <= a.axis < len(n.shape):
        return f"qsoftmax axis {a.get('axis')!r} is not an axis of {list(n.shape)}"
    if not isinstance(a.get("m"), int) or not 0 < a.m < 2**31:
        return "qsoftmax needs an output multiplier m in (0, 2^31)"
    rng, zp = a.get("range"), a.get("zp")
    if not (isinstance(rng, tuple) and len(rng) == 2 and all(isinstance(v, int) for v in rng)
            and isinstance(zp, int) and n.dtype.range[0] <= rng[0] <= zp <= rng[1]
            <= n.dtype.range[1]):
        return "qsoftmax zp and range must lie in the result dtype's range"
    return None


def _qlayernorm(n: Node) -> str | None:
    x, a = n.src[0], n.attrs
    if not (n.dtype.is_int8 or n.dtype is DType.F32) or n.shape != x.shape or not n.shape:
        return "qlayernorm maps int8 codes to int8 codes or f32 values of the same shape"
    width = n.shape[-1]
    tables = [a.get(k) for k in ("g", "b", "sh")]
    if not all(isinstance(t, np.ndarray) and t.dtype == np.int64 and t.shape == (width,)
               for t in tables):
        return "qlayernorm needs i64 g, b and sh with one entry per element of the last axis"
    if np.any(a.sh < qmath.LN_Z_FRAC) or np.any(a.sh > qmath.MAX_SHIFT) or \
            np.any(np.abs(a.g) >= 2**31) or np.any(np.abs(a.b) > 2**61):
        return "qlayernorm g, b or sh outside the bounds that keep its i64 arithmetic exact"
    if width > qmath.LN_MAX_N or not isinstance(a.get("e"), int) or a.e < 0:
        return f"qlayernorm needs rows of at most {qmath.LN_MAX_N} and an integer e >= 0"
    if x.dtype is DType.F32:
        problem = _qlayernorm_float_input(n)
        if problem:
            return problem
    elif not x.dtype.is_int8:
        return f"qlayernorm reads i8/u8 codes or f32 values, not {x.dtype.value}"
    if n.dtype is DType.F32:
        return None
    rng, zp = a.get("range"), a.get("zp")
    lo, hi = n.dtype.range
    if not (isinstance(rng, tuple) and len(rng) == 2 and isinstance(zp, int)
            and lo <= rng[0] <= rng[1] <= hi and lo <= zp <= hi):
        return "qlayernorm zp and range must lie in the result dtype's range"
    return None


def _qlayernorm_float_input(n: Node) -> str | None:
    a, width = n.attrs, n.shape[-1]
    keys = ("code_bits", "k_max", "e_shift")
    if not all(isinstance(a.get(k), int) for k in keys):
        return "qlayernorm on f32 needs integer code_bits, k_max and e_shift"
    if width * width << (2 * a.code_bits) > 2**52 or a.code_bits <= 0 or \
            not a.k_max <= qmath.LNF_MAX_K or a.e > 2**41 or \
            (a.e and 2 * a.k_max - a.e_shift + 41 > 51):
        return "qlayernorm on f32: code_bits, k_max or e outside the bounds of exact i64 arithmetic"
    return None


def _mask_lut(n: Node) -> str | None:
    x, m = n.src
    t = n.attrs.get("table")
    lo, hi = x.dtype.range if x.dtype.is_int8 else (0, -1)
    if not isinstance(t, np.ndarray) or t.dtype != np.int64 or t.shape != (4, hi - lo + 1):
        return "mask_lut needs an i64 table [4, one entry per code of its first input]"
    if not n.dtype.is_int8 or n.shape != x.shape or np.any(t < n.dtype.range[0]) or \
            np.any(t > n.dtype.range[1]):
        return "mask_lut maps int8 codes to int8 codes of the same shape"
    if m.dtype.is_float or m.dtype is DType.BOOL or \
            np.broadcast_shapes(m.shape, x.shape) != x.shape:
        return f"mask_lut needs an integer mask that broadcasts to {list(x.shape)}"
    return None


def _layout(n: Node) -> str | None:
    """Convolutions and pools are NCHW or NHWC (channels-last); channel counts must agree."""
    layout = n.attrs.get("layout", "nchw")
    if layout not in ("nchw", "nhwc"):
        return f"layout must be 'nchw' or 'nhwc', is {layout!r}"
    if len(n.shape) != 4 or len(n.src[0].shape) != 4:
        return None if layout == "nchw" else "nhwc convolutions and pools are 4-D"
    c = 1 if layout == "nchw" else 3
    x = n.src[0]
    if n.op is Op.QCONV2D:
        w = n.src[1]
        if x.shape[c] != w.shape[c] * n.attrs.groups or n.shape[c] != w.shape[0]:
            return (f"{layout} conv: input {list(x.shape)}, weights {list(w.shape)} (groups "
                    f"{n.attrs.groups}) and result {list(n.shape)} disagree on channels")
    elif x.shape[c] != n.shape[c] or x.shape[0] != n.shape[0]:
        return f"{layout} pool changes channels: {list(x.shape)} -> {list(n.shape)}"
    return None


def _permute(n: Node) -> str | None:
    dims = tuple(n.attrs.get("dims", ()))
    x = n.src[0]
    if sorted(dims) != list(range(len(x.shape))):
        return f"dims {dims} are no permutation of {len(x.shape)} axes"
    if n.shape != tuple(x.shape[d] for d in dims):
        return f"permute {dims} of {list(x.shape)} is not {list(n.shape)}"
    return None


def _channel_axis(n: Node) -> str | None:
    qp = n.attrs.get("qp")
    if isinstance(qp, QParams) and qp.axis is not None and n.shape[qp.axis] != len(qp.scale):
        return f"qp has {len(qp.scale)} channels, axis {qp.axis} has {n.shape[qp.axis]}"
    return None


def _same_dtype(n: Node) -> str | None:
    if n.src and n.src[0].dtype.is_int8 and any(s.dtype is not n.dtype for s in n.src):
        return "int8 data movement keeps the dtype of its operands"
    return None


RULES: dict[Op, tuple[Rule, ...]] = {
    Op.INPUT: (lambda n: _arity(n, 0),
               lambda n: None if "name" in n.attrs else "input needs a name"),
    Op.CONST: (lambda n: _arity(n, 0), _const),
    Op.QUANT: (lambda n: _arity(n, 1), _quant),
    Op.DEQUANT: (lambda n: _arity(n, 1), _dequant, _channel_axis),
    Op.QCONV2D: (lambda n: _arity(n, 3), _contraction, _layout),
    Op.QLINEAR: (lambda n: _arity(n, 3), _contraction),
    Op.QMATMUL: (lambda n: _arity(n, 2), _contraction),
    Op.QMUL: (lambda n: _arity(n, 2), _contraction),
    Op.QSUMPOOL2D: (lambda n: _arity(n, 1), _contraction, _layout),
    Op.QSUM: (lambda n: _arity(n, 1), _contraction),
    Op.REQUANT: (lambda n: _arity(n, 1, 8), _requant),
    Op.LUT: (lambda n: _arity(n, 1), _lut),
    Op.QSOFTMAX: (lambda n: _arity(n, 1), lambda n: _int_src(n, 0), _qsoftmax),
    Op.QLAYERNORM: (lambda n: _arity(n, 1), _qlayernorm),
    Op.MASK_LUT: (lambda n: _arity(n, 2), lambda n: _int_src(n, 0), _mask_lut),
    **{op: (_same_dtype,) for op in DATA_MOVEMENT},
    Op.PERMUTE: (lambda n: _arity(n, 1), _same_dtype, _permute),
    Op.MAXPOOL2D: (lambda n: _arity(n, 1), _same_dtype, _layout),
}


def _shape_ok(n: Node) -> str | None:
    if any(d < 0 for d in n.shape):
        return f"negative dimension in {list(n.shape)}"
    return None


def verify(g: Graph, *, stage: str = "") -> None:
    """Raise :class:`VerifyError` on the first node that breaks a rule."""
    for n in g.nodes():
        for rule in (_shape_ok, *RULES.get(n.op, ())):
            problem = rule(n)
            if problem:
                where = f" after {stage}" if stage else ""
                raise VerifyError(f"QIR verifier{where}: {n.op.value} at {n.loc or '?'}: "
                                  f"{problem}")

"""Lowering of the integer anchors — convolution, linear, matmul, sum pool, sum — and the max pool,
each with its chain's epilogue (:mod:`qcompile.codegen.triton.epilogue`).

Contractions read s8 operands: a u8 activation is shifted by 128 on load, and its zero point
(shifted too) is folded into the bias, ``bias - zp' * rowsum(W)``, so a convolution pads with
the zero point and the kernel sums plain int8 products on tensor cores. Convolutions are NHWC
(the channels-last pass runs before code generation); an NCHW one goes to the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qcompile.codegen.triton.epilogue import Epilogue, end_axis, epilogue, flat_channels
from qcompile.codegen.triton.program import OUT, Launch, Ref, Step
from qcompile.codegen.triton.tiles import conv_algorithm, gemm_tile, pow2_at_least, window_tile
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType

if TYPE_CHECKING:
    from qcompile.codegen.triton.lower import Lowerer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def s8_offset(dtype: DType) -> int:
    """What a load subtracts to make the operand s8 (u8 codes minus 128)."""
    return 128 if dtype is DType.U8 else 0


def folded_bias(bias: np.ndarray, w: np.ndarray, zp: int) -> np.ndarray:
    """``bias - zp * rowsum(W)`` per output channel, in i64."""
    rows = w.reshape(w.shape[0], -1).astype(np.int64).sum(axis=1)
    return np.asarray(bias, dtype=np.int64) - int(zp) * rows


def _covers(anchor: Node, end: Node | None) -> tuple[Node, ...]:
    return (anchor,) if end is None else (anchor, end)


def _label(anchor: Node, end: Node | None) -> str:
    return "+".join(n.op.value for n in _covers(anchor, end))


def _residual(lw: Lowerer, ep: Epilogue, out: Node) -> Ref | object:
    if ep.residual is None:
        return OUT
    return lw.ref(ep.residual, expand=out.shape)


def _int8_consts(n: Node) -> tuple[np.ndarray, np.ndarray] | None:
    w, b = n.src[1], n.src[2]
    if w.op is not Op.CONST or b.op is not Op.CONST:
        return None
    return np.asarray(w.attrs.value), np.asarray(b.attrs.value)


def conv(lw: Lowerer, n: Node, end: Node | None) -> Step | None:
    """QCONV2D (NHWC, weights OHWI) + epilogue: implicit GEMM on tensor cores, or the direct
    window kernel for narrow groups (depthwise)."""
    a = n.attrs
    consts = _int8_consts(n)
    if a.get("layout") != "nhwc" or consts is None:
        return None
    w, bias = consts
    x = n.src[0]
    f, kh, kw, cg = w.shape
    x_off = s8_offset(x.dtype)
    out = end or n
    ep = epilogue(end, out.shape, len(out.shape) - 1, folded_bias(bias, w, a.x_zp - x_off),
                  lut=lw.table_after(end))
    if ep is None:
        return None
    algo = lw.conv if lw.conv != "auto" else conv_algorithm(a.groups, cg)
    return _conv_step(lw, n, end, w, ep, algo, a.groups, a.get("dilation", (1, 1)))


def _conv_step(lw: Lowerer, n: Node, end: Node | None, w: np.ndarray, ep: Epilogue, algo: str,
               groups: int, dil: tuple[int, int]) -> Step:
    a = n.attrs
    f, kh, kw, cg = w.shape
    x_off = s8_offset(n.src[0].dtype)
    x = n.src[0]
    out = end or n
    nb, h, wd, c = x.shape
    _, oh, ow, _ = n.shape
    m = nb * oh * ow
    geometry = (h, wd, c, oh, ow, f, *a.stride, *a.padding, *dil, a.x_zp, *ep.scalars())
    tensors = (lw.ref(x), lw.tensor(w.reshape(f, -1).astype(np.int8)), OUT, _residual(lw, ep, out),
               lw.tensor(ep.table), lw.tensor(ep.scale))
    if algo == "igemm":
        fg, k = f // groups, kh * kw * cg
        t = gemm_tile(m, fg, k)
        launch = Launch("conv2d_igemm", (cdiv(m, t.bm), cdiv(fg, t.bn), groups),
                        (*tensors, m, fg, k, *geometry),
                        {"KW": kw, "CG": cg, "X_OFF": x_off, **ep.consts(), "BM": t.bm,
                         "BN": t.bn, "BK": t.bk}, t.warps, t.stages, t.describe())
    else:
        wt = window_tile(m, f)
        launch = Launch("conv2d_direct", (cdiv(m, wt.bm), cdiv(f, wt.bc), 1),
                        (*tensors, m, *geometry),
                        {"KH": kh, "KW": kw, "CG": cg, "FG": f // groups, "X_OFF": x_off,
                         **ep.consts(), "BM": wt.bm, "BC": wt.bc}, wt.warps, 1, wt.describe())
    return lw.step(out, _covers(n, end), launch, _label(n, end))


def sumpool(lw: Lowerer, n: Node, end: Node | None) -> Step | None:
    """QSUMPOOL2D: window sums of ``x - zp`` — a depthwise convolution with unit weights whose
    folded bias is ``-zp' * KH * KW`` (padding holds the zero point and adds nothing)."""
    a = n.attrs
    if a.get("layout") != "nhwc":
        return None
    x = n.src[0]
    c = x.shape[3]
    kh, kw = a.kernel
    x_off = s8_offset(x.dtype)
    out = end or n
    bias = np.full(c, -(a.x_zp - x_off) * kh * kw, dtype=np.int64)
    ep = epilogue(end, out.shape, len(out.shape) - 1, bias, lut=lw.table_after(end))
    if ep is None:
        return None
    unit = np.ones((c, kh, kw, 1), dtype=np.int8)
    return _conv_step(lw, n, end, unit, ep, "direct", c, (1, 1))


def linear(lw: Lowerer, n: Node, end: Node | None) -> Step | None:
    """QLINEAR ``x[..., K] @ W[N, K]^T``: the GEMM kernel with W read transposed."""
    consts = _int8_consts(n)
    if consts is None:
        return None
    w, bias = consts
    x = n.src[0]
    nn, k = w.shape
    m = x.numel // k
    x_off = s8_offset(x.dtype)
    out = end or n
    ep = epilogue(end, out.shape, len(out.shape) - 1, folded_bias(bias, w, n.attrs.x_zp - x_off),
                  lut=lw.table_after(end))
    if ep is None:
        return None
    t = gemm_tile(m, nn, k)
    args = (lw.ref(x), lw.tensor(w.astype(np.int8)), OUT, _residual(lw, ep, out),
            lw.tensor(ep.table), lw.tensor(ep.scale), m, nn, k, 0, k, 1, 0, 1, k, 0, 0, 0,
            *ep.scalars())
    consts_ = {"A_OFF": x_off, "B_OFF": 0, "ZP_FIX": False, **ep.consts(), "BM": t.bm,
               "BN": t.bn, "BK": t.bk}
    launch = Launch("gemm", (cdiv(m, t.bm), cdiv(nn, t.bn), 1), args, consts_, t.warps, t.stages,
                    t.describe())
    return lw.step(out, _covers(n, end), launch, _label(n, end))


def matmul(lw: Lowerer, n: Node, end: Node | None) -> Step | None:
    """QMATMUL of two int8 activations (attention), batched with broadcasting: both zero
    points are subtracted after the int8 product (``ZP_FIX``)."""
    a, b = n.src
    if not (a.dtype.is_int8 and b.dtype.is_int8):
        return None
    *batch, m, nn = n.shape
    k = a.shape[-1]
    nbatch = int(np.prod(batch, dtype=np.int64))
    out = end or n
    ep = epilogue(end, out.shape, len(out.shape) - 1, 0, lut=lw.table_after(end))
    if ep is None:
        return None
    a_off, b_off = s8_offset(a.dtype), s8_offset(b.dtype)
    za, zb = n.attrs.a_zp - a_off, n.attrs.b_zp - b_off
    t = gemm_tile(m, nn, k)
    args = (lw.ref(a, expand=(*batch, m, k), view=(nbatch, m, k)),
            lw.ref(b, expand=(*batch, k, nn), view=(nbatch, k, nn)), OUT,
            _residual(lw, ep, out), lw.tensor(ep.table), lw.tensor(ep.scale), m, nn, k,
            m * k, k, 1, k * nn, nn, 1, za, zb, k * za * zb, *ep.scalars())
    consts = {"A_OFF": a_off, "B_OFF": b_off, "ZP_FIX": bool(za or zb), **ep.consts(),
              "BM": t.bm, "BN": t.bn, "BK": t.bk}
    launch = Launch("gemm", (cdiv(m, t.bm), cdiv(nn, t.bn), nbatch), args, consts, t.warps,
                    t.stages, t.describe())
    return lw.step(out, _covers(n, end), launch, _label(n, end))


def qsum(lw: Lowerer, n: Node, end: Node | None) -> Step | None:
    """QSUM over a contiguous block of dims (a mean over H, W): ``[OUTER, R, INNER]`` rows."""
    x = n.src[0]
    nd = len(x.shape)
    dims = sorted(d % nd for d in n.attrs.dims)
    if dims != list(range(dims[0], dims[-1] + 1)):
        return None
    outer = int(np.prod(x.shape[:dims[0]], dtype=np.int64))
    r = int(np.prod(x.shape[dims[0]:dims[-1] + 1], dtype=np.int64))
    inner = int(np.prod(x.shape[dims[-1] + 1:], dtype=np.int64))
    out = end or n
    axis = end_axis(end, len(out.shape))
    ep = epilogue(end, out.shape, axis, 0, lut=lw.table_after(end))
    if ep is None:
        return None
    ch, ch_inner = flat_channels(out.shape, axis)
    bi, br = pow2_at_least(inner, 16, 128), pow2_at_least(r, 16, 64)
    args = (lw.ref(x), OUT, _residual(lw, ep, out), lw.tensor(ep.table), lw.tensor(ep.scale), r,
            inner, n.attrs.x_zp, ch, ch_inner, *ep.scalars())
    launch = Launch("sum_rows", (outer, cdiv(inner, bi), 1), args,
                    {**ep.consts(), "BR": br, "BI": bi}, 4, 1, f"{br}x{bi}")
    return lw.step(out, _covers(n, end), launch, _label(n, end))


def maxpool(lw: Lowerer, n: Node) -> Step | None:
    """NHWC int8 max pool (float or NCHW pools go to the host)."""
    a = n.attrs
    x = n.src[0]
    if a.get("layout") != "nhwc" or not x.dtype.is_int8:
        return None
    nb, h, wd, c = x.shape
    _, oh, ow, _ = n.shape
    m = nb * oh * ow
    kh, kw = a.kernel
    wt = window_tile(m, c)
    args = (lw.ref(x), OUT, m, h, wd, c, oh, ow, *a.stride, *a.padding,
            *a.get("dilation", (1, 1)))
    consts = {"KH": kh, "KW": kw, "LO": x.dtype.range[0], "BM": wt.bm, "BC": wt.bc}
    launch = Launch("maxpool2d", (cdiv(m, wt.bm), cdiv(c, wt.bc), 1), args, consts, wt.warps, 1,
                    wt.describe())
    return lw.step(n, (n,), launch, "maxpool2d")


ANCHORS = {Op.QCONV2D: conv, Op.QLINEAR: linear, Op.QMATMUL: matmul, Op.QSUMPOOL2D: sumpool,
           Op.QSUM: qsum}

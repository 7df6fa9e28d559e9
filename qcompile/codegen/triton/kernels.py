"""Triton kernels of the ``cuda`` target. Integer semantics: :mod:`qcompile.ir.qmath`.

Every kernel that ends a fused chain applies the same epilogue (:func:`_epilogue`) in registers
to its i64 value tile ``v`` and stores only the result: int8 (requantize), f32 (dequantize, for
logits) or i32 (an accumulator read by more than one consumer). The per-channel constants of an
epilogue are one i64 table ``ep[5, F]``:

====  =====================================================================================
row   meaning
====  =====================================================================================
0     bias: the i32 bias with the zero-point terms folded in (minus the first term's zero
      point; for a dequantize, minus its zero point)
1     multiplier of the first term (the accumulator); for a dequantize, the scale's 24-bit
      significand ``m``
2     multiplier of the second term (the residual operand read from ``res``)
3     rounding constant ``2^(shift-1)``
4     shift
====  =====================================================================================

and ``scale[F]`` (f32, ``2^-sh``) for a dequantize, ``out = float32(v * m) * 2^-sh``
(:func:`qcompile.ir.qmath.dequantize_array`). Otherwise
``out = clamp(((v + bias) * M0 + (r - zr) * M1 + rnd) >> shift + zp_out, qmin, qmax)`` in i64,
exactly :func:`qcompile.ir.qmath.requantize`.

Contractions run on int8 tensor cores: ``tl.dot(s8, s8, out_dtype=int32)``. u8 activations are
shifted to s8 on load (``x - 128``; the zero point moves by 128) and the activation zero point
is folded into the bias at compile time (``sum (x - zp) w = sum x w - zp * rowsum(w)``), so the
padding of a convolution is the zero point itself and contributes nothing.

The kernels are written once and loaded twice by :mod:`qcompile.codegen.triton.loader`: compiled
(``triton.jit``, for a GPU or ahead of time) and interpreted (``TRITON_INTERPRET``, on the CPU).
So they call only Triton builtins and each other — not the jit-defined helpers of Triton's
standard library (``tl.zeros``, ``tl.sum``, ``tl.cdiv``, ...), which exist in one mode per
process: ``tl.full`` and :func:`_sum` stand in for them.
"""

# ruff: noqa: N803 - Triton constexpr parameters are upper case by convention

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sum(x, AXIS: tl.constexpr):
    """``tl.sum`` without its jit wrapper: the standard library's jit functions stay compiled
    objects in a process that also interprets (see the loader), while ``tl.reduce`` with this
    combine function is a builtin in both modes (the interpreter maps it onto ``np.sum``)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def _max(x, AXIS: tl.constexpr):
    """``tl.max`` without its jit wrapper (as :func:`_sum`)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


@triton.jit
def _epilogue(v, chan, chan_ok, offs, mask, out, res, ep, scale, F, zr, zp_out, qmin, qmax,
              EPI: tl.constexpr, HAS_RES: tl.constexpr):
    """Bias, then keep i32 (``EPI`` 0), requantize (1), dequantize (2) or requantize and look
    the codes up in a 256-entry table (3, ``scale[code + 128]``) — the ``epilogue.EPI_*``
    modes; stores ``out[offs]`` under ``mask``. ``chan`` (broadcastable to
    ``v``) indexes the per-channel tables."""
    v = v + tl.load(ep + chan, mask=chan_ok, other=0)
    if EPI == 0:
        tl.store(out + offs, v.to(tl.int32), mask=mask)
    elif EPI == 2:                 # qmath.dequantize_array: (v * m) to f32, times 2^-sh
        f = (v * tl.load(ep + F + chan, mask=chan_ok, other=0)).to(tl.float32) * \
            tl.load(scale + chan, mask=chan_ok, other=0.0)
        tl.store(out + offs, f, mask=mask)
    else:
        total = v * tl.load(ep + F + chan, mask=chan_ok, other=0)
        if HAS_RES:
            r = tl.load(res + offs, mask=mask, other=0).to(tl.int64)
            total += (r - zr) * tl.load(ep + 2 * F + chan, mask=chan_ok, other=0)
        rnd = tl.load(ep + 3 * F + chan, mask=chan_ok, other=0)
        shift = tl.load(ep + 4 * F + chan, mask=chan_ok, other=1)
        q = ((total + rnd) >> shift) + zp_out
        q = tl.minimum(tl.maximum(q, qmin), qmax)
        if EPI == 3:               # a table after the requantize (scale[code + 128], f32)
            q = tl.load(scale + (q + 128).to(tl.int32), mask=mask, other=0.0).to(tl.int64)
        tl.store(out + offs, q.to(out.dtype.element_ty), mask=mask)


@triton.jit
def conv2d_igemm(x, w, out, res, ep, scale,
                 M, FG, K, H, W, C, OH, OW, F, sh, sw, ph, pw, dh, dw, xpad,
                 zr, zp_out, qmin, qmax,
                 KW: tl.constexpr, CG: tl.constexpr, X_OFF: tl.constexpr,
                 EPI: tl.constexpr, HAS_RES: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Implicit-GEMM convolution, NHWC input ``x[N, H, W, C]``, weights ``w[F, KH*KW*CG]``
    (OHWI), output ``out[N*OH*OW, F]``. Rows are output pixels, columns the ``FG`` output
    channels of group ``program_id(2)``, ``K = KH*KW*CG`` with the channel fastest. The A tile
    is gathered from the input (strided, dilated; outside the image it is the zero point
    ``xpad``) and never materialised."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    fl = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    f_ok = fl < FG
    nb = rm // (OH * OW)
    pix = rm % (OH * OW)
    ih0 = (pix // OW) * sh - ph
    iw0 = (pix % OW) * sw - pw
    xrow = nb * (H * W * C) + g * CG
    wrow = (g * FG + fl) * K
    acc = tl.full((BM, BN), 0, tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        tap = rk // CG
        ih = ih0[:, None] + (tap // KW)[None, :] * dh
        iw = iw0[:, None] + (tap % KW)[None, :] * dw
        inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a_ptr = x + xrow[:, None] + (ih * W + iw) * C + (rk % CG)[None, :]
        a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :] & inside, other=xpad)
        a = (a.to(tl.int32) - X_OFF).to(tl.int8)
        b = tl.load(w + wrow[None, :] + rk[:, None], mask=k_ok[:, None] & f_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    chan = g * FG + fl
    offs = rm[:, None] * F + chan[None, :]
    _epilogue(acc.to(tl.int64), chan[None, :], f_ok[None, :], offs, m_ok[:, None] & f_ok[None, :],
              out, res, ep, scale, F, zr, zp_out, qmin, qmax, EPI, HAS_RES)


@triton.jit
def gemm(a, b, out, res, ep, scale, M, N, K,
         s_ab, s_am, s_ak, s_bb, s_bk, s_bn, za, zb, kzz, zr, zp_out, qmin, qmax,
         A_OFF: tl.constexpr, B_OFF: tl.constexpr, ZP_FIX: tl.constexpr,
         EPI: tl.constexpr, HAS_RES: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Batched ``a[B, M, K] x b[B, K, N] -> out[B, M, N]`` (strided operands; batch
    ``program_id(2)``). A linear layer has a constant ``b`` (its weight ``[N, K]`` read
    transposed) with zero point 0; a matmul of two activations (``ZP_FIX``) subtracts both
    zero points after the int8 product: ``sum (a-za)(b-zb) = sum ab - zb*rowsum(a) -
    za*colsum(b) + K*za*zb`` (``kzz = K*za*zb``), with the row and column sums taken from the
    same tiles. Scalars are used in arithmetic only: Triton may specialise an int argument to a
    constant."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bt = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    a_ptr = a + bt * s_ab + rm[:, None] * s_am
    b_ptr = b + bt * s_bb + rn[None, :] * s_bn
    acc = tl.full((BM, BN), 0, tl.int32)
    row_sum = tl.full((BM,), 0, tl.int32)
    col_sum = tl.full((BN,), 0, tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(a_ptr + rk[None, :] * s_ak, mask=m_ok[:, None] & k_ok[None, :], other=A_OFF)
        x = (x.to(tl.int32) - A_OFF).to(tl.int8)
        y = tl.load(b_ptr + rk[:, None] * s_bk, mask=k_ok[:, None] & n_ok[None, :], other=B_OFF)
        y = (y.to(tl.int32) - B_OFF).to(tl.int8)
        acc = tl.dot(x, y, acc, out_dtype=tl.int32)
        if ZP_FIX:
            row_sum += _sum(x.to(tl.int32), 1)
            col_sum += _sum(y.to(tl.int32), 0)
    v = acc.to(tl.int64)
    if ZP_FIX:
        v = v - zb * row_sum.to(tl.int64)[:, None] - za * col_sum.to(tl.int64)[None, :] + kzz
    offs = (bt * M + rm)[:, None] * N + rn[None, :]
    _epilogue(v, rn[None, :], n_ok[None, :], offs, m_ok[:, None] & n_ok[None, :],
              out, res, ep, scale, N, zr, zp_out, qmin, qmax, EPI, HAS_RES)


@triton.jit
def conv2d_direct(x, w, out, res, ep, scale,
                  M, H, W, C, OH, OW, F, sh, sw, ph, pw, dh, dw, xpad, zr, zp_out, qmin, qmax,
                  KH: tl.constexpr, KW: tl.constexpr, CG: tl.constexpr, FG: tl.constexpr,
                  X_OFF: tl.constexpr, EPI: tl.constexpr, HAS_RES: tl.constexpr,
                  BM: tl.constexpr, BC: tl.constexpr):
    """Direct window convolution for few input channels per group (depthwise: ``CG = 1``), on
    CUDA cores: a tile of output pixels × output channels, summed over the window in i32.
    Also the sum pool (unit weights)."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rf = pid_c * BC + tl.arange(0, BC)
    m_ok = rm < M
    f_ok = rf < F
    nb = rm // (OH * OW)
    pix = rm % (OH * OW)
    ih0 = (pix // OW) * sh - ph
    iw0 = (pix % OW) * sw - pw
    cin = (rf // FG) * CG
    acc = tl.full((BM, BC), 0, tl.int32)
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            ih = ih0 + i * dh
            iw = iw0 + j * dw
            inside = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            base = nb * (H * W * C) + (ih * W + iw) * C
            for ci in tl.static_range(CG):
                xv = tl.load(x + base[:, None] + (cin + ci)[None, :],
                             mask=inside[:, None] & f_ok[None, :], other=xpad)
                wv = tl.load(w + rf * (KH * KW * CG) + (i * KW + j) * CG + ci, mask=f_ok, other=0)
                acc += (xv.to(tl.int32) - X_OFF) * wv.to(tl.int32)[None, :]
    offs = rm[:, None] * F + rf[None, :]
    _epilogue(acc.to(tl.int64), rf[None, :], f_ok[None, :], offs, m_ok[:, None] & f_ok[None, :],
              out, res, ep, scale, F, zr, zp_out, qmin, qmax, EPI, HAS_RES)


@triton.jit
def maxpool2d(x, out, M, H, W, C, OH, OW, sh, sw, ph, pw, dh, dw,
              KH: tl.constexpr, KW: tl.constexpr, LO: tl.constexpr,
              BM: tl.constexpr, BC: tl.constexpr):
    """NHWC int8 max pool; outside the image counts as the lowest code ``LO``."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rc = pid_c * BC + tl.arange(0, BC)
    m_ok = rm < M
    c_ok = rc < C
    nb = rm // (OH * OW)
    pix = rm % (OH * OW)
    ih0 = (pix // OW) * sh - ph
    iw0 = (pix % OW) * sw - pw
    acc = tl.full((BM, BC), LO, x.dtype.element_ty)
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            ih = ih0 + i * dh
            iw = iw0 + j * dw
            inside = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            base = nb * (H * W * C) + (ih * W + iw) * C
            v = tl.load(x + base[:, None] + rc[None, :], mask=inside[:, None] & c_ok[None, :],
                        other=LO)
            acc = tl.maximum(acc, v)
    tl.store(out + rm[:, None] * C + rc[None, :], acc, mask=m_ok[:, None] & c_ok[None, :])


@triton.jit
def sum_rows(x, out, res, ep, scale, R, INNER, xzp, CH, CH_INNER, zr, zp_out, qmin, qmax,
             EPI: tl.constexpr, HAS_RES: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """``out[o, i] = sum_r (x[o, r, i] - xzp)`` over a ``[OUTER, R, INNER]`` view (a mean over
    H and W in NHWC), then the epilogue; the channel of an output is ``(flat // CH_INNER) %
    CH``."""
    o = tl.program_id(0)
    ri = tl.program_id(1) * BI + tl.arange(0, BI)
    i_ok = ri < INNER
    acc = tl.full((BI,), 0, tl.int32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        v = tl.load(x + o * R * INNER + rr[:, None] * INNER + ri[None, :],
                    mask=(rr < R)[:, None] & i_ok[None, :], other=0)
        acc += _sum(v.to(tl.int32), 0)
    total = acc.to(tl.int64) - R * xzp
    offs = o * INNER + ri
    chan = (offs // CH_INNER) % CH
    _epilogue(total, chan, i_ok, offs, i_ok, out, res, ep, scale, CH, zr, zp_out, qmin, qmax,
              EPI, HAS_RES)


@triton.jit
def requant_flat(x0, x1, out, ep, scale, n, za, zb, CH, CH_INNER, zr, zp_out, qmin, qmax,
                 MUL: tl.constexpr, EPI: tl.constexpr, HAS_RES: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Elementwise epilogue over flat tensors: a requantize of one or two terms (an int8 add,
    a rescale), a dequantize, or with ``MUL`` the int8 product ``(x0 - za)(x1 - zb)`` first."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n
    v = tl.load(x0 + o, mask=ok, other=0).to(tl.int64)
    if MUL:
        v = (v - za) * (tl.load(x1 + o, mask=ok, other=0).to(tl.int64) - zb)
    chan = (o // CH_INNER) % CH
    _epilogue(v, chan, ok, o, ok, out, x1, ep, scale, CH, zr, zp_out, qmin, qmax, EPI, HAS_RES)


@triton.jit
def _round_half_even(y):
    """Round half to even, spelled out with floor (exact in f32)."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def quantize(x, out, inv, zp, n, CH, CH_INNER, qlo, qhi, BLOCK: tl.constexpr):
    """PT2E's quantize ``clamp(round_half_even(x * (1/s)) + zp)`` in f32. Rounding is spelled
    out with floor (exact in f32) so interpreter and GPU agree; launched without FMA
    contraction so ``x * inv`` is rounded once, as numpy does."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n
    chan = (o // CH_INNER) % CH
    y = tl.load(x + o, mask=ok, other=0.0) * tl.load(inv + chan, mask=ok, other=1.0)
    q = _round_half_even(y) + tl.load(zp + chan, mask=ok, other=0.0)
    q = tl.minimum(tl.maximum(q, qlo), qhi)
    tl.store(out + o, q.to(tl.int32).to(out.dtype.element_ty), mask=ok)


@triton.jit
def qsoftmax(x, table, out, S, M2, ZP, QMIN, QMAX, LO: tl.constexpr, SHIFT: tl.constexpr,
             BLOCK: tl.constexpr):
    """One row of ``S`` int8 codes per program: :func:`qcompile.ir.qmath.softmax_codes` in i64
    (the row max, exp-table entries of each distance to it, their sum, one divide each)."""
    row = tl.program_id(0).to(tl.int64) * S
    c = tl.arange(0, BLOCK)
    ok = c < S
    v = tl.load(x + row + c, mask=ok, other=LO).to(tl.int32)
    mx = _max(v, 0)
    e = tl.load(table + (mx - v), mask=ok, other=0)
    total = _sum(e, 0)
    q = (e * M2 + (total << SHIFT)) // (total << (SHIFT + 1)) + ZP
    q = tl.minimum(tl.maximum(q, QMIN), QMAX)
    tl.store(out + row + c, q.to(out.dtype.element_ty), mask=ok)


@triton.jit
def qlayernorm(x, g, b, sh, scale, out, S, XZP, E, R_ONE, ZP, QMIN, QMAX, CB, K_MAX, E_SHIFT,
               ROOT_SHIFT: tl.constexpr, Z_SHIFT: tl.constexpr, MARGIN: tl.constexpr,
               FLOAT_IN: tl.constexpr, FLOAT_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """One row of ``S`` values per program: :func:`qcompile.ir.qmath.layernorm_fixed` on int8
    codes, or (``FLOAT_IN``) :func:`qcompile.ir.qmath.layernorm_fixed_float` on float32 values
    (codes of the row's power-of-two scale from the exponent bits of its max, and the row's eps
    term), in i64: row sums, an exact integer square root from a float32 estimate, one divide,
    then the fixed-point affine map per element; int8 codes or (``FLOAT_OUT``) float32 times
    ``scale`` = 2^-SH. ``R_ONE`` is 2^40 (2^48 on float32 values)."""
    row = tl.program_id(0).to(tl.int64) * S
    col = tl.arange(0, BLOCK)
    ok = col < S
    if FLOAT_IN:
        xv = tl.load(x + row + col, mask=ok, other=0.0)
        bits = (_max(tl.abs(xv), 0).to(tl.int32, bitcast=True) >> 23) & 255
        k = tl.minimum(CB + 126 - bits, K_MAX)
        power = ((k + 127) << 23).to(tl.float32, bitcast=True)
        c = tl.where(ok, _round_half_even(xv * power).to(tl.int64), 0)
        d = 2 * k.to(tl.int64) - E_SHIFT
        e0 = tl.full((), E, tl.int64)
        eps = tl.where(d >= 0, e0 << tl.maximum(d, 0), e0 >> tl.minimum(-d, 63))
    else:
        c = tl.where(ok, tl.load(x + row + col, mask=ok, other=0).to(tl.int64) - XZP, 0)
        eps = tl.full((), E, tl.int64)
    s1 = _sum(c, 0)
    v = ((_sum(c * c, 0) * S - s1 * s1) << ROOT_SHIFT) + eps
    r = tl.sqrt(v.to(tl.float32)).to(tl.int64) + tl.where(v < 65536, 1, MARGIN)
    r = tl.maximum((r + v // r) >> 1, 1)    # qmath.LN_NEWTON_STEPS Newton steps, never 0
    r = tl.maximum((r + v // r) >> 1, 1)
    r = tl.maximum((r + v // r) >> 1, 1)
    r = tl.maximum(tl.where(r * r > v, r - 1, r), 1)
    recip = (R_ONE + (r >> 1)) // r
    z = ((c * S - s1) * recip + (1 << (Z_SHIFT - 1))) >> Z_SHIFT
    t = z * tl.load(g + col, mask=ok, other=0) + tl.load(b + col, mask=ok, other=0)
    if FLOAT_OUT:
        y = t.to(tl.float32) * tl.load(scale + col, mask=ok, other=0.0)
        tl.store(out + row + col, y, mask=ok)
    else:
        shift = tl.load(sh + col, mask=ok, other=1)
        half = tl.full((BLOCK,), 1, tl.int64) << (shift - 1)
        q = tl.minimum(tl.maximum(((t + half) >> shift) + ZP, QMIN), QMAX)
        tl.store(out + row + col, q.to(out.dtype.element_ty), mask=ok)


@triton.jit
def mask_lut(x, m, table, out, n, LO: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``out = table[clamp(m, -1, 2) + 1][x - LO]``; ``m`` is the mask broadcast to ``x``."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n
    v = tl.load(x + o, mask=ok, other=LO).to(tl.int32) - LO
    row = tl.minimum(tl.maximum(tl.load(m + o, mask=ok, other=0).to(tl.int64), -1), 2) + 1
    tl.store(out + o, tl.load(table + (row.to(tl.int32) * WIDTH + v), mask=ok, other=0),
             mask=ok)


@triton.jit
def lut(x, table, out, n, LO: tl.constexpr, BLOCK: tl.constexpr):
    """``out = table[x - LO]``: a 256-entry table of an elementwise float function."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n
    v = tl.load(x + o, mask=ok, other=LO).to(tl.int32) - LO
    tl.store(out + o, tl.load(table + v, mask=ok, other=0), mask=ok)


@triton.jit
def attention(q, k, v, m, mtab, etab, out, S, HD, D, M_STRIDE, zq, zk, zv, zp, kzz, szz,
              b1, m1, r1, s1, z1, lo1, hi1, M2, SZP, SLO, SHI, b2, m2, r2, s2, z2, lo2, hi2,
              Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr,
              HAS_MASK: tl.constexpr, CLO: tl.constexpr, SHIFT: tl.constexpr,
              BQ: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    """One fused attention chain (:mod:`qcompile.codegen.fusions`) for ``BQ`` query rows of
    one head (``program_id(1)``) of image ``program_id(2)``: ``q·kᵀ`` on int8 tensor cores with
    both zero points subtracted after the product (``kzz = D·zq·zk``), the requantize, the mask
    table (``mtab[4, 256]``, each key's row ``clamp(mask, -1, 2) + 1``), the int8 softmax of
    :func:`qcompile.ir.qmath.softmax_codes` over the row (all ``S <= BS`` keys in one tile),
    ``p·v`` (p shifted to s8, ``szz = S·zp·zv``) and the second requantize, stored into the
    head's ``D`` columns of the merged ``[N, S, H·D]`` output. q, k, v are ``[N, S, H·D]``
    (``HD = H·D``); zero points are those of the shifted s8 operands."""
    rq = tl.program_id(0) * BQ + tl.arange(0, BQ)
    head = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    rs = tl.arange(0, BS)
    rd = tl.arange(0, BD)
    q_ok = rq < S
    s_ok = rs < S
    d_ok = rd < D
    base = n * S * HD + head * D
    qt = tl.load(q + base + rq[:, None] * HD + rd[None, :], mask=q_ok[:, None] & d_ok[None, :],
                 other=Q_OFF)
    qt = (qt.to(tl.int32) - Q_OFF).to(tl.int8)                       # [BQ, BD]
    kt = tl.load(k + base + rs[None, :] * HD + rd[:, None], mask=d_ok[:, None] & s_ok[None, :],
                 other=K_OFF)
    kt = (kt.to(tl.int32) - K_OFF).to(tl.int8)                       # [BD, BS]: kᵀ
    acc = tl.dot(qt, kt, tl.full((BQ, BS), 0, tl.int32), out_dtype=tl.int32).to(tl.int64)
    acc = acc - zk * _sum(qt.to(tl.int32), 1).to(tl.int64)[:, None] - \
        zq * _sum(kt.to(tl.int32), 0).to(tl.int64)[None, :] + kzz
    c = ((acc + b1) * m1 + r1 >> s1) + z1
    c = tl.minimum(tl.maximum(c, lo1), hi1).to(tl.int32)
    if HAS_MASK:
        mrow = tl.load(m + n * M_STRIDE + rs, mask=s_ok, other=1)
        mrow = (tl.minimum(tl.maximum(mrow, -1), 2) + 1).to(tl.int32)
        c = tl.load(mtab + (mrow[None, :] * 256 + (c - CLO)), mask=s_ok[None, :], other=0)
    c = tl.where(s_ok[None, :], c, -1024)
    mx = _max(c, 1)
    e = tl.load(etab + (mx[:, None] - c), mask=s_ok[None, :], other=0)   # i64
    total = _sum(e, 1)
    p = (e * M2 + (total << SHIFT)[:, None]) // (total << (SHIFT + 1))[:, None] + SZP
    p = tl.minimum(tl.maximum(p, SLO), SHI)
    p8 = tl.where(s_ok[None, :], p - 128, 0).to(tl.int8)              # [BQ, BS]
    vt = tl.load(v + base + rs[:, None] * HD + rd[None, :], mask=s_ok[:, None] & d_ok[None, :],
                 other=V_OFF)
    vt = (vt.to(tl.int32) - V_OFF).to(tl.int8)                       # [BS, BD]
    o = tl.dot(p8, vt, tl.full((BQ, BD), 0, tl.int32), out_dtype=tl.int32).to(tl.int64)
    o = o - zv * _sum(p8.to(tl.int32), 1).to(tl.int64)[:, None] - \
        zp * _sum(vt.to(tl.int32), 0).to(tl.int64)[None, :] + szz
    y = ((o + b2) * m2 + r2 >> s2) + z2
    y = tl.minimum(tl.maximum(y, lo2), hi2)
    tl.store(out + base + rq[:, None] * HD + rd[None, :], y.to(out.dtype.element_ty),
             mask=q_ok[:, None] & d_ok[None, :])

"""The integer semantics of qcompile — one definition, used by the reference interpreter and by
every code generator.

* Accumulate in i32. Bias is quantized to i32 with scale ``s_x * s_w[c]``.
* Requantize with a fixed-point multiplier ``M`` (``2^30 <= M < 2^31`` for the largest term of a
  channel) and a right shift ``s`` (``1 <= s <= 62``) per output channel:
  ``round_shift(v, s) = (v + 2^(s-1)) >> s`` (arithmetic shift: round half up), computed in i64.
  Several terms (a residual operand, the two sides of an int8 add) share the shift of a channel.
* Then add the output zero point and clamp to ``[qmin, qmax]``; relu/relu6/hardtanh are folded into
  that clamp.

The rounding differs from PT2E's float ``round-half-even(y / s_out)`` only on exact ties and in
the last bits of ``M``: compiled code is checked bit-exact against this module, and this module
within one quantization step of PT2E.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from qcompile.ir.types import DType, QParams, Requant, Term

MANTISSA_BITS = 31
MAX_SHIFT = 62


def _shift_for(real: float) -> int:
    """The shift that puts ``real * 2^shift`` in ``[2^30, 2^31)``, clamped to ``[1, 62]``."""
    if real <= 0.0:
        return MAX_SHIFT
    _, exponent = math.frexp(real)          # real = f * 2^exponent, f in [0.5, 1)
    return min(MAX_SHIFT, max(1, MANTISSA_BITS - exponent))


def fixed_point(reals: Sequence[Sequence[float]]) -> tuple[tuple[tuple[int, ...], ...],
                                                           tuple[int, ...]]:
    """Multipliers per term and one shift per channel for ``reals[term][channel]``.

    The largest term of each channel sets the shift so no multiplier exceeds 31 bits.
    """
    terms = [np.asarray(r, dtype=np.float64) for r in reals]
    channels = max(len(t) for t in terms)
    terms = [np.broadcast_to(t, (channels,)) for t in terms]
    if any(np.any(t < 0) or not np.all(np.isfinite(t)) for t in terms):
        raise ValueError("requantize multipliers must be finite and non-negative")
    biggest = np.max(np.stack(terms), axis=0)
    if np.any(biggest >= 2.0 ** (MANTISSA_BITS - 1)):
        raise ValueError(f"requantize multiplier {float(np.max(biggest))} is too large")
    shifts = tuple(_shift_for(float(r)) for r in biggest)
    mults = tuple(tuple(min(int(round(float(r) * 2.0**s)), 2**MANTISSA_BITS - 1)
                        for r, s in zip(t, shifts, strict=True)) for t in terms)
    return mults, shifts


def make_requant(reals: Sequence[Sequence[float]], zero_points: Sequence[int], out: QParams,
                 *, axis: int | None, qmin: int | None = None,
                 qmax: int | None = None) -> Requant:
    """A :class:`Requant` mapping terms with real multipliers ``reals`` onto ``out``."""
    mults, shifts = fixed_point(reals)
    terms = tuple(Term(int(z), m) for z, m in zip(zero_points, mults, strict=True))
    lo = out.qmin if qmin is None else max(out.qmin, qmin)
    hi = out.qmax if qmax is None else min(out.qmax, qmax)
    return Requant(terms, shifts, out.zp, lo, hi, out.dtype, axis if len(shifts) > 1 else None)


def per_channel(values: Sequence[int], axis: int | None, ndim: int) -> np.ndarray:
    """``values`` shaped to broadcast along ``axis`` of a rank-``ndim`` tensor."""
    arr = np.asarray(values, dtype=np.int64)
    if axis is None or arr.size == 1:
        return arr.reshape(())
    shape = [1] * ndim
    shape[axis] = arr.size
    return arr.reshape(shape)


def requantize(rq: Requant, *operands: np.ndarray) -> np.ndarray:
    """Execute a :class:`Requant` on integer arrays (the definition every target must match)."""
    if len(operands) != len(rq.terms):
        raise ValueError(f"requant takes {len(rq.terms)} operands, got {len(operands)}")
    ndim = max(np.ndim(x) for x in operands)
    total = np.zeros((), dtype=np.int64)
    for x, term in zip(operands, rq.terms, strict=True):
        centred = np.asarray(x, dtype=np.int64) - term.zero_point
        total = total + centred * per_channel(term.multiplier, rq.axis, ndim)
    shift = per_channel(rq.shift, rq.axis, ndim)
    rounded = (total + (np.int64(1) << (shift - 1))) >> shift
    out = np.clip(rounded + rq.zp_out, rq.qmin, rq.qmax)
    return out.astype(rq.out_dtype.np)


def quantize_bias(bias: np.ndarray, acc_scale: np.ndarray) -> np.ndarray:
    """Float bias → i32 at scale ``s_x * s_w[c]`` (round half to even, saturating)."""
    q = np.round(np.asarray(bias, dtype=np.float64) / np.asarray(acc_scale, dtype=np.float64))
    info = np.iinfo(np.int32)
    return np.clip(q, info.min, info.max).astype(np.int32)


def acc_scales(x: QParams, w: QParams) -> np.ndarray:
    """Per-output-channel scale of an i32 accumulator of ``x`` times ``w``."""
    return np.asarray(x.scale, dtype=np.float64) * np.asarray(w.scale, dtype=np.float64)


def quantize_array(x: np.ndarray, qp: QParams) -> np.ndarray:
    """PT2E's quantize: ``clamp(round_half_even(x / s) + zp)`` (in float32 like PT2E)."""
    scale, zp = broadcast_qparams(qp, np.ndim(x))
    inv = (np.float32(1.0) / scale.astype(np.float32)).astype(np.float32)
    q = np.round(np.asarray(x, dtype=np.float32) * inv) + zp
    return np.clip(q, qp.qmin, qp.qmax).astype(qp.dtype.np)


def scale_fixed(scale: np.ndarray | Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(m, p)`` with ``float32(scale) = m * p`` exactly: ``m`` the 24-bit integer significand
    (i64), ``p = 2^-sh`` (float32). Scales must lie in ``[2^-100, 2^100]``."""
    s32 = np.asarray(scale, np.float32)
    if np.any(~(np.abs(s32) >= 2.0**-100)) or np.any(np.abs(s32) > 2.0**100):
        raise ValueError(f"dequantize scale outside [2^-100, 2^100]: {s32}")
    frac, exp = np.frexp(s32.astype(np.float64))        # s = frac * 2^exp, frac in [0.5, 1)
    m = np.ldexp(frac, 24).astype(np.int64)              # exact: float32 has 24 bits
    return m, np.ldexp(np.float32(1.0), exp - 24).astype(np.float32)


def dequantize_array(q: np.ndarray, qp: QParams) -> np.ndarray:
    """``float32((q - zp) * m) * 2^-sh`` with ``scale = m * 2^-sh`` (:func:`scale_fixed`): the
    one rounding is the integer product's conversion, the power of two is exact. It equals
    PT2E's ``float32(q - zp) * scale`` wherever ``q - zp`` fits 24 bits (int8 codes), and an
    addition that reads it gives the same float whether or not a compiler contracts the two into
    a fused multiply-add (the product is exact)."""
    scale, zp = broadcast_qparams(qp, np.ndim(q))
    m, p = scale_fixed(scale)
    return ((np.asarray(q, dtype=np.int64) - zp) * m).astype(np.float32) * p


def broadcast_qparams(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    scale = np.asarray(qp.scale, dtype=np.float64)
    zp = np.asarray(qp.zero_point, dtype=np.int64)
    if qp.axis is None:
        return scale.reshape(()), zp.reshape(())
    shape = [1] * ndim
    shape[qp.axis] = scale.size
    return scale.reshape(shape), zp.reshape(shape)


def lut_table(fn: object, x: QParams, out: QParams) -> np.ndarray:
    """The 256-entry table of ``Q_out(fn(DQ_x(q)))`` over every int8 input value."""
    lo, hi = x.dtype.range
    codes = np.arange(lo, hi + 1)
    real = dequantize_array(codes, x)
    return quantize_array(fn(real), out)  # type: ignore[operator]


def int8_dtype(name: str) -> DType:
    return {"uint8": DType.U8, "int8": DType.I8}[name]


# -- int8 softmax ------------------------------------------------------------------------------
# softmax of int8 codes along an axis, int8 codes out, in integers only:
#   d = max(x) - x                        (0..255: a row's codes against its largest)
#   e = T[d],  T[k] = round(2^EXP_BITS * exp(-s_x * k))       (the row's largest gives 2^EXP_BITS)
#   q = zp_out + round_half_up(e * M / (sum(e) * 2^OUT_SHIFT)),  M = round(2^OUT_SHIFT / s_out)
# then clamped. In i64: e <= 2^22 and M < 2^31 (s_out >= 2^-14), so 2 * e * M < 2^54;
# sum(e) * 2^17 <= n * 2^39 (rows shorter than 2^20).
SOFTMAX_EXP_BITS = 22
SOFTMAX_OUT_SHIFT = 16


def softmax_table(x: QParams) -> np.ndarray:
    """``T[k] = round(2^22 * exp(-s_x * k))`` for every code distance ``k`` of ``x``'s dtype."""
    lo, hi = x.dtype.range
    k = np.arange(hi - lo + 1, dtype=np.float64)
    return np.round(np.exp(-float(x.scale[0]) * k) * 2.0**SOFTMAX_EXP_BITS).astype(np.int64)


def softmax_multiplier(out: QParams) -> int:
    """``M = round(2^16 / s_out)``: the output scale as a fixed-point reciprocal."""
    return int(round(2.0**SOFTMAX_OUT_SHIFT / float(out.scale[0])))


def softmax_codes(x: np.ndarray, axis: int, table: np.ndarray, multiplier: int, zp: int,
                  qrange: tuple[int, int]) -> np.ndarray:
    """The int8 softmax above on codes ``x`` (any integer dtype), as int64 codes."""
    v = x.astype(np.int64)
    e = table[v.max(axis=axis, keepdims=True) - v]
    total = e.sum(axis=axis, keepdims=True)
    q = zp + (2 * e * multiplier + (total << SOFTMAX_OUT_SHIFT)) // \
        (total << (SOFTMAX_OUT_SHIFT + 1))
    return np.clip(q, *qrange)


# -- int8 layer norm -----------------------------------------------------------------------------
# layer_norm of int8 codes over the last axis (n values), in integers only:
#   c = x - zp_x;  S1 = sum(c);  S2 = sum(c^2)                  (i64)
#   V = n*S2 - S1^2  (= n^2 var, in codes^2);  E = round(2^16 * eps * n^2 / s_x^2)
#   root = isqrt((V << 16) + E)  (1 where that is 0)           (= 2^8 * n * std, floored)
#   R = (2^40 + root // 2) // root                              (= 2^32 / (n * std))
#   z = round_half_up((n*c - S1) * R, 8)                        ((x - mean) / std, 24 fraction bits)
#   t = z * G[c] + B[c]                                         (the result, SH[c] fraction bits)
# with G = gamma / s_out and B = beta / s_out as fixed point of SH fraction bits (SH - 24 for G).
# int8 out: q = zp_out + round_half_up(t, SH[c]), clamped. float out (s_out = 1): float32(t) *
# 2^-SH[c], two correctly rounded steps, so every target gives the same float.
# Bounds: |n*c - S1| <= sqrt(n V), so |z| <= sqrt(n) 2^24 < 2^30 for n <= LN_MAX_N; |G| < 2^31 and
# |B| <= 2^61 keep the i64 sum below 2^62; (V << 16) + E < 2^53, so a float64 square root is
# exact to within one before the integer fix-up.
LN_ROOT_SHIFT = 16
LN_R_BITS = 40
LN_Z_SHIFT = 8
LN_Z_FRAC = 24
LN_MAX_N = 2896
LN_MAX_ROOT_ARG = 2**53
# How targets without an exact isqrt get it: a float32 square root plus this margin lies above
# isqrt (float32's error there is about 9); Newton's integer step from above never undershoots
# and cuts an excess e to e^2 / 2r (75 -> 9 -> 0.2), so three steps and one fix-up are exact.
LN_ISQRT_MARGIN = 64
LN_NEWTON_STEPS = 3


def layernorm_params(x: QParams, n: int, eps: float, gamma: np.ndarray, beta: np.ndarray,
                     out_scale: float) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(E, G, B, SH)`` of the int8 layer norm above (``out_scale`` 1.0 for a float result), or
    ``None`` where its integers could overflow (rows longer than ``LN_MAX_N``, an ``eps`` huge
    against ``s_x``, non-finite affine parameters)."""
    if n > LN_MAX_N:
        return None
    e = round(eps * n * n * 2.0**LN_ROOT_SHIFT / float(x.scale[0]) ** 2)
    span = x.dtype.range[1] - x.dtype.range[0]
    if e >= LN_MAX_ROOT_ARG or (n * n * span * span // 4 << LN_ROOT_SHIFT) + e >= LN_MAX_ROOT_ARG:
        return None
    affine = _layernorm_affine(gamma, beta, out_scale)
    return None if affine is None else (e, *affine)


def _layernorm_affine(gamma: np.ndarray, beta: np.ndarray, out_scale: float
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(G, B, SH)``: gamma and beta over ``out_scale`` as fixed point (``None`` where they
    are not finite or too large for i64)."""
    gamma = np.asarray(gamma, np.float64).reshape(-1)
    beta = np.asarray(beta, np.float64).reshape(-1)
    if not (np.all(np.isfinite(gamma)) and np.all(np.isfinite(beta))):
        return None
    g_real, b_real = gamma / out_scale, beta / out_scale
    # SH: G gets 31 significant bits unless B would then pass 2^61 (or SH pass MAX_SHIFT)
    g_bits = np.array([_shift_for(abs(float(v))) for v in g_real]) + LN_Z_FRAC
    b_room = 61 - np.ceil(np.log2(np.abs(b_real) + 1.0)).astype(np.int64)
    sh = np.minimum(np.minimum(g_bits, b_room), MAX_SHIFT).astype(np.int64)
    if np.any(sh < LN_Z_FRAC):
        return None
    g = np.round(g_real * np.exp2(sh - LN_Z_FRAC)).astype(np.int64)
    b = np.round(b_real * np.exp2(sh)).astype(np.int64)
    return g, b, sh


# The layer norm of a float32 row in integers (``QLAYERNORM`` on an f32 input, e.g. a residual
# stream kept float). Layer norm does not change when its row is scaled, so each row becomes codes
# of its own power-of-two scale, exactly:
#   k = min(CB + 126 - exponent_bits(max |x|), K_MAX)    (max |x| < 2^(CB - k): |c| <= 2^CB)
#   c = round_half_even(x * 2^k)                          (f32; the multiply is exact)
# then the steps above with V not shifted (V <= n^2 4^CB <= 2^52 by the choice of the code bits
# CB), E = eps * n^2 * 4^k for that row, and 2^48 / root, so z keeps 24 fraction bits:
#   root = isqrt(V + E_row) (1 where 0);  R = (2^48 + root // 2) // root
#   z = round_half_up((n*c - S1) * R, 24);  t = z * G[c] + B[c]    (G, B, SH as above)
# eps * n^2 is held as e * 2^-e_shift (e in [2^40, 2^41]), so E_row = e * 2^(2k - e_shift),
# floored. K_MAX (at most 126, so 2^k is a normal float32) keeps E_row <= 2^51: a row whose
# largest value is below 2^(CB - K_MAX) has a variance far below eps, and its smaller codes still
# resolve x / sqrt(var + eps) to 2^-18. Every step is exact integer arithmetic (the max, the
# exponent and the power of two included), so every target returns the same result bit for bit.
# A row holding inf or NaN has no defined result.
LNF_R_BITS = 48
LNF_Z_SHIFT = 24
LNF_E_BITS = 40
LNF_MAX_K = 126


def layernorm_shifts(float_input: bool) -> tuple[int, int, int]:
    """``(root_shift, r_bits, z_shift)`` of the steps above: the int8 layer norm's, or (f32
    input) the float-input one's."""
    if float_input:
        return 0, LNF_R_BITS, LNF_Z_SHIFT
    return LN_ROOT_SHIFT, LN_R_BITS, LN_Z_SHIFT


FloatLayerNormParams = tuple[int, int, int, int, np.ndarray, np.ndarray, np.ndarray]


def layernorm_float_params(n: int, eps: float, gamma: np.ndarray, beta: np.ndarray,
                           out_scale: float) -> FloatLayerNormParams | None:
    """``(CB, K_MAX, e, e_shift, G, B, SH)`` of the float-input layer norm above, or ``None``
    (rows longer than ``LN_MAX_N``, affine parameters that do not fit)."""
    if n > LN_MAX_N or not eps >= 0.0 or not math.isfinite(eps):
        return None
    code_bits = 26                                 # the most with n^2 4^CB <= 2^52
    while n * n << (2 * code_bits) > 2**52:
        code_bits -= 1
    e, e_shift, k_max = 0, 0, LNF_MAX_K
    if eps > 0.0:
        _, exponent = math.frexp(eps * n * n)      # eps n^2 in [2^(exponent-1), 2^exponent)
        e_shift = LNF_E_BITS + 1 - exponent
        e = round(math.ldexp(eps * n * n, e_shift))
        k_max = min(k_max, (e_shift + 10) // 2)    # e * 2^(2k - e_shift) <= 2^51
    affine = _layernorm_affine(gamma, beta, out_scale)
    return None if affine is None else (code_bits, k_max, e, e_shift, *affine)


def layernorm_float_codes(x: np.ndarray, code_bits: int, k_max: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """``(c, k)`` of the float-input layer norm: each row's codes (i64) and its ``k`` (i64,
    keepdims)."""
    x = np.asarray(x, np.float32)
    m = np.max(np.abs(x), axis=-1, keepdims=True)
    exponent_bits = (m.view(np.int32) >> 23) & 0xFF
    k = np.minimum(code_bits + 126 - exponent_bits, k_max).astype(np.int64)
    power = ((k + 127) << 23).astype(np.int32).view(np.float32)
    return np.rint(x * power).astype(np.int64), k


def layernorm_row_eps(k: np.ndarray, e: int, e_shift: int) -> np.ndarray:
    """``E_row = floor(e * 2^(2k - e_shift))`` (at most 2^51 for ``k <= K_MAX``)."""
    d = 2 * np.asarray(k, np.int64) - e_shift
    return np.where(d >= 0, np.int64(e) << np.maximum(d, 0), np.int64(e) >> np.minimum(-d, 63))


def isqrt_rows(v: np.ndarray) -> np.ndarray:
    """``floor(sqrt(v))`` of non-negative i64 values below 2^53, exactly."""
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(np.int64)
    r = r - (r * r > v)
    return r + ((r + 1) * (r + 1) <= v)


def layernorm_fixed(x: np.ndarray, zp_x: int, e: int, g: np.ndarray, b: np.ndarray
                    ) -> np.ndarray:
    """``t`` of the int8 layer norm above over the last axis of codes ``x`` (i64)."""
    return _layernorm_t(x.astype(np.int64) - zp_x, e, g, b, *layernorm_shifts(False))


def layernorm_fixed_float(x: np.ndarray, code_bits: int, k_max: int, e: int, e_shift: int,
                          g: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``t`` of the float-input layer norm above over the last axis of float32 ``x``."""
    c, k = layernorm_float_codes(x, code_bits, k_max)
    return _layernorm_t(c, layernorm_row_eps(k, e, e_shift), g, b, *layernorm_shifts(True))


def _layernorm_t(c: np.ndarray, e: int | np.ndarray, g: np.ndarray, b: np.ndarray,
                 root_shift: int, r_bits: int, z_shift: int) -> np.ndarray:
    n = c.shape[-1]
    s1 = c.sum(axis=-1, keepdims=True)
    s2 = (c * c).sum(axis=-1, keepdims=True)
    root = np.maximum(isqrt_rows(((n * s2 - s1 * s1) << root_shift) + e), 1)
    r = ((np.int64(1) << r_bits) + (root >> 1)) // root
    z = ((n * c - s1) * r + (1 << (z_shift - 1))) >> z_shift
    return z * g + b


def layernorm_codes(t: np.ndarray, sh: np.ndarray, zp: int, qrange: tuple[int, int]
                    ) -> np.ndarray:
    """int8 out: ``zp + round_half_up(t, SH)``, clamped (int64 codes)."""
    return np.clip(zp + ((t + (np.int64(1) << (sh - 1))) >> sh), *qrange)


def layernorm_float(t: np.ndarray, sh: np.ndarray) -> np.ndarray:
    """float out: ``float32(t) * 2^-SH``."""
    return t.astype(np.float32) * np.ldexp(np.float32(1.0), -sh).astype(np.float32)

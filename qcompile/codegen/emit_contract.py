"""Emitters of the integer contractions and pools.

Contractions are written in the form IREE's fast int8 path recognises (see the IREE int8 study):
a ``linalg.generic`` over ``extui(u8 activation) * extsi(s8 weight)`` into a zero-filled i32
accumulator. The activation zero point is folded into the bias at compile time
(``sum (x - zp) w = sum x w - zp * sum w``) and the bias is added by the consumer's epilogue
(:class:`qcompile.codegen.mlir_emit.Acc`). Signed int8 activations are flipped to u8
(``x ^ 0x80``, zero point + 128) first.

Convolutions (NHWC; NCHW operands are transposed at the edges):

* 1×1, no padding: the activation is the GEMM's LHS as it is (strided slice first);
* K×K: an im2col of KH·KW strided slices of the zero-point-padded input, then one GEMM;
* grouped and depthwise: one direct window ``linalg.generic`` per group layout.

An M=1 GEMM (a classifier at batch 1) is computed on two rows: IREE's inner-tiled VNNI path
cannot tile a vector times a matrix.
"""

from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg

from qcompile.codegen import builder as b
from qcompile.codegen.builder import TV
from qcompile.codegen.mlir_emit import (
    Acc,
    Emitter,
    Pending,
    Value,
    emits,
    materialize,
    unsupported,
)
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import DType

I32_MIN, I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


def _flip(x: TV, to: DType) -> TV:
    """``x ^ 0x80``: u8 ↔ s8 with the zero point moved by 128 (the caller's)."""
    return b.elementwise([x], x.shape, to, lambda a, _o: arith.xori(a, b.ci(-128, 8)))


def as_u8(x: TV, zp: int) -> tuple[TV, int]:
    """Signed int8 activations become u8 (``x ^ 0x80``) with zero point ``zp + 128``."""
    return (x, zp) if x.dtype is not DType.I8 else (_flip(x, DType.U8), zp + 128)


def as_s8(x: TV, zp: int) -> tuple[TV, int]:
    """u8 values become s8 (``x ^ 0x80``) with zero point ``zp - 128``."""
    return (x, zp) if x.dtype is not DType.U8 else (_flip(x, DType.I8), zp - 128)


def folded_bias(bias: np.ndarray, w_rows: np.ndarray, zp: int, where: Node) -> np.ndarray:
    """``bias - zp * rowsum(W)`` (checked to fit i32)."""
    out = bias.astype(np.int64) - int(zp) * w_rows.reshape(w_rows.shape[0], -1).astype(
        np.int64).sum(axis=1)
    if out.min(initial=0) < I32_MIN or out.max(initial=0) > I32_MAX:
        raise unsupported(where, "folded bias overflows i32")
    return out


def gemm_u8s8(a: TV, w: np.ndarray) -> TV:
    """``a[M,K]`` (u8, or s8 for the GEMV form) times ``w[N,K]`` (s8, constant) → i32
    ``[M,N]``, zero-initialised."""
    m, k = a.shape
    nn = w.shape[0]
    if a.dtype is DType.I8:
        # s8 x s8: the named op, which IREE's data tiling hands to its mmt4d ukernel
        wt = b.constant(np.ascontiguousarray(w.T), DType.I8)
        init = b.filled((m, nn), DType.I32, b.ci(0, 32))
        return TV(linalg.matmul(a.value, wt.value, outs=[init]), DType.I32, (m, nn))
    wc = b.constant(w, DType.I8)
    d = b.dims(3)
    maps = [b.amap(3, [d[0], d[2]]), b.amap(3, [d[1], d[2]]), b.amap(3, [d[0], d[1]])]
    init = b.filled((m, nn), DType.I32, b.ci(0, 32))

    def body(x: ir.Value, y: ir.Value, acc: ir.Value) -> ir.Value:
        return arith.addi(acc, arith.muli(b.widen(x, a.dtype, 32), b.widen(y, DType.I8, 32)))

    res = b.generic([a.value, wc.value], [a.dtype, DType.I8], (m, nn), [DType.I32], maps,
                    ["parallel", "parallel", "reduction"], body, inits=[init])
    return TV(res[0], DType.I32, (m, nn))


def contract_rows(em: Emitter, a: TV, zp: int, w: np.ndarray, bias: np.ndarray,
                  where: Node) -> tuple[TV, np.ndarray]:
    """The GEMM of u8 rows ``a`` with ``w[N,K]`` and the bias its epilogue must add.

    IREE 3.13's inner-tiled path cannot tile a one-row GEMM (a classifier at batch 1): that row
    is padded to two and row 0 is sliced out of the result, past a barrier (IREE fails when the
    slice shares the GEMM's dispatch). Such a chain is two dispatches; its i32 row is written.
    With ``s8_contractions`` the rows are flipped to s8 first (see ``EmitOptions``)."""
    if em.opts.s8_contractions:
        a, zp = as_s8(a, zp)
    if a.shape[0] != 1:
        return gemm_u8s8(a, w), folded_bias(bias, w, zp, where)
    two = b.pad(a, [0, 0], [1, 0], b.ci(zp, 8))
    acc = b.extract_slice(b.barrier(gemm_u8s8(two, w)), [0, 0], [1, w.shape[0]], [1, 1])
    return acc, folded_bias(bias, w, zp, where)


@emits(Op.QLINEAR)
def _qlinear(em: Emitter, n: Node, v: list[Value]) -> Value:
    if id(n) in em.uk_chains:
        return Pending(materialize(v[0]))
    x, zp = as_u8(materialize(v[0]), n.attrs.x_zp)
    w, bias = np.asarray(n.src[1].attrs.value), np.asarray(n.src[2].attrs.value)
    k = x.shape[-1]
    rows = b.reshape(x, (int(np.prod(x.shape[:-1])), k))
    acc, folded = contract_rows(em, rows, zp, w, bias, n)
    return Acc(b.reshape(acc, n.shape), folded, len(n.shape) - 1)


def _weights_ohwi(n: Node) -> np.ndarray:
    w = np.asarray(n.src[1].attrs.value)
    return w if n.attrs.get("layout") == "nhwc" else np.transpose(w, (0, 2, 3, 1))


@emits(Op.QCONV2D)
def _qconv(em: Emitter, n: Node, v: list[Value]) -> Value:
    a = n.attrs
    nchw = a.get("layout") != "nhwc"
    x = materialize(v[0])
    if id(n) in em.uk_chains:
        return Pending(x)
    if nchw:
        x = b.transpose(x, (0, 2, 3, 1))
    x, zp = as_u8(x, a.x_zp)
    w = _weights_ohwi(n)
    bias = np.asarray(n.src[2].attrs.value)
    (ph, pw), (sh, sw), (dh, dw) = a.padding, a.stride, a.dilation
    from qcompile.codegen.emit_ukernel import prepadded

    pre = None if nchw else prepadded(em, n, (ph, pw), int(a.x_zp))
    if pre is not None:
        xp = pre
    else:
        with em.loc(n, ".copy"):
            xp = b.pad(x, [0, ph, pw, 0], [0, ph, pw, 0], b.ci(zp, 8))
    f, kh, kw, cg = w.shape
    nb, _, _, c = x.shape
    oh, ow = (n.shape[2], n.shape[3]) if nchw else (n.shape[1], n.shape[2])
    if a.groups == 1:
        with em.loc(n, ".copy"):
            rows = _im2col(xp, (kh, kw), (sh, sw), (dh, dw), (oh, ow))
        acc, folded = contract_rows(em, rows, zp, w.reshape(f, -1), bias, n)
        out = b.reshape(acc, (nb, oh, ow, f))
    else:
        out = _grouped(xp, w, a.groups, (sh, sw), (dh, dw), (oh, ow))
        folded = folded_bias(bias, w, zp, n)
    if nchw:
        out = b.transpose(out, (0, 3, 1, 2))
    return Acc(out, folded, 1 if nchw else 3)


def _im2col(xp: TV, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int],
            o: tuple[int, int]) -> TV:
    """Rows ``[N*OH*OW, KH*KW*C]`` of the padded NHWC input, built from strided slices."""
    nb, c = xp.shape[0], xp.shape[3]
    sizes = [nb, o[0], o[1], c]
    if k == (1, 1):
        part = b.extract_slice(xp, [0, 0, 0, 0], sizes, [1, s[0], s[1], 1])
        return b.reshape(part, (nb * o[0] * o[1], c))
    col = TV(b.empty((nb, o[0], o[1], k[0] * k[1], c), xp.dtype), xp.dtype,
             (nb, o[0], o[1], k[0] * k[1], c))
    for i in range(k[0]):
        for j in range(k[1]):
            part = b.extract_slice(xp, [0, i * d[0], j * d[1], 0], sizes, [1, s[0], s[1], 1])
            col = b.insert_slice(part, col, [0, 0, 0, i * k[1] + j, 0],
                                 [nb, o[0], o[1], 1, c])
    return b.reshape(col, (nb * o[0] * o[1], k[0] * k[1] * c))


def _grouped(xp: TV, w: np.ndarray, groups: int, s: tuple[int, int], dl: tuple[int, int],
             o: tuple[int, int]) -> TV:
    """Direct window convolution per group: loops (n, oh, ow, g, [fg], kh, kw, [cg])."""
    f, kh, kw, cg = w.shape
    fg = f // groups
    nb = xp.shape[0]
    depthwise = fg == 1 and cg == 1
    if depthwise:
        names = ["n", "oh", "ow", "g", "kh", "kw"]
        x = xp
        wt = np.transpose(w.reshape(groups, kh, kw), (1, 2, 0))     # KH, KW, C
    else:
        names = ["n", "oh", "ow", "g", "fg", "kh", "kw", "cg"]
        x = b.reshape(xp, (*xp.shape[:3], groups, cg))
        wt = w.reshape(groups, fg, kh, kw, cg)
    d = dict(zip(names, b.dims(len(names)), strict=True))
    h = d["oh"] * s[0] + d["kh"] * dl[0]
    ww = d["ow"] * s[1] + d["kw"] * dl[1]
    nd = len(names)
    if depthwise:
        x_map = b.amap(nd, [d["n"], h, ww, d["g"]])
        w_map = b.amap(nd, [d["kh"], d["kw"], d["g"]])
        out_shape: tuple[int, ...] = (nb, o[0], o[1], groups)
        o_map = b.amap(nd, [d["n"], d["oh"], d["ow"], d["g"]])
    else:
        x_map = b.amap(nd, [d["n"], h, ww, d["g"], d["cg"]])
        w_map = b.amap(nd, [d["g"], d["fg"], d["kh"], d["kw"], d["cg"]])
        out_shape = (nb, o[0], o[1], groups, fg)
        o_map = b.amap(nd, [d["n"], d["oh"], d["ow"], d["g"], d["fg"]])
    wc = b.constant(wt, DType.I8)
    iters = ["reduction" if k in ("kh", "kw", "cg") else "parallel" for k in names]
    init = b.filled(out_shape, DType.I32, b.ci(0, 32))

    def body(xv: ir.Value, wv: ir.Value, acc: ir.Value) -> ir.Value:
        return arith.addi(acc, arith.muli(b.widen(xv, DType.U8, 32), b.widen(wv, DType.I8, 32)))

    res = b.generic([x.value, wc.value], [DType.U8, DType.I8], out_shape, [DType.I32],
                    [x_map, w_map, o_map], iters, body, inits=[init])
    return b.reshape(TV(res[0], DType.I32, out_shape), (nb, o[0], o[1], f))


def _batch_map(shape: tuple[int, ...], out: tuple[int, ...], d: list, tail: list) -> ir.AffineMap:
    lead = len(out) - 2
    own = len(shape) - 2
    exprs: list = []
    for i in range(own):
        j = lead - own + i
        exprs.append(0 if shape[i] == 1 and out[j] != 1 else d[j])
    return b.amap(len(d), exprs + tail)


@emits(Op.QMATMUL)
def _qmatmul(em: Emitter, n: Node, v: list[Value]) -> Value:
    """Activation × activation (attention): ``(a - za)(b - zb)`` summed in i32, batched.

    Where both operands have the output's batch dims it is a batch GEMM in IREE's u8 × s8 form
    (:func:`_qmatmul_u8s8`); a broadcast batch keeps the direct form below."""
    x, y = materialize(v[0]), materialize(v[1])
    if id(n) in em.uk_chains:
        return Pending(x, y)
    out = n.shape
    if x.shape[:-2] == y.shape[:-2] == tuple(out[:-2]):
        return _qmatmul_u8s8(em, n, x, y)
    za, zb = n.attrs.a_zp, n.attrs.b_zp
    nd = len(out) + 1
    d = b.dims(nd)
    m, nn, k = d[len(out) - 2], d[len(out) - 1], d[len(out)]
    maps = [_batch_map(x.shape, out, d, [m, k]), _batch_map(y.shape, out, d, [k, nn]),
            b.amap(nd, d[:len(out)])]
    init = b.filled(out, DType.I32, b.ci(0, 32))

    def body(p: ir.Value, q: ir.Value, acc: ir.Value) -> ir.Value:
        p32 = arith.subi(b.widen(p, x.dtype, 32), b.ci(za, 32))
        q32 = arith.subi(b.widen(q, y.dtype, 32), b.ci(zb, 32))
        return arith.addi(acc, arith.muli(p32, q32))

    res = b.generic([x.value, y.value], [x.dtype, y.dtype], out, [DType.I32], maps,
                    ["parallel"] * len(out) + ["reduction"], body, inits=[init])
    return TV(res[0], DType.I32, out)


def _transposed_source(em: Emitter, n: Node) -> TV | None:
    """The tensor a ``permute`` swapping the last two dims reads, when ``n`` is one."""
    if n.op is not Op.PERMUTE:
        return None
    r = len(n.shape)
    if tuple(n.attrs.dims) != (*range(r - 2), r - 1, r - 2):
        return None
    src = em.values.get(id(n.src[0]))
    return src if isinstance(src, TV) else None


def _qmatmul_u8s8(em: Emitter, n: Node, x: TV, y: TV) -> TV:
    """``sum (a - za)(b - zb)`` as one u8 × s8 batch GEMM plus rank-1 corrections:
    ``sum a b' - zb' rowsum(a) - za colsum(b') + K za zb'`` with ``b' = b - 128`` (u8 ``b``
    flipped to s8; ``zb' = zb - 128``). The identity holds in wrapping i32 arithmetic, so the
    result is exactly the direct form's. A ``b`` transposed from ``[..., N, K]`` (attention's
    ``Kᵀ``) is read in place, as the GEMM's ``[N, K]`` operand."""
    out = n.shape
    batch = int(np.prod(out[:-2], dtype=np.int64))
    mm, kk, nn = x.shape[-2], x.shape[-1], out[-1]
    a, za = as_u8(x, n.attrs.a_zp)
    yt = _transposed_source(em, n.src[1])
    transposed = yt is not None
    bt, zb = as_s8(yt if transposed else y, n.attrs.b_zp)
    # operands fenced: IREE would otherwise fold a producer's head-split transpose into the
    # GEMM's indexing maps, re-creating it without its preset strategy (then data tiling fails)
    a3 = b.barrier(b.reshape(a, (batch, mm, kk)))
    b3 = b.barrier(b.reshape(bt, (batch, nn, kk) if transposed else (batch, kk, nn)))
    bi, mi, ni, ki = b.dims(4)
    maps = [b.amap(4, [bi, mi, ki]), b.amap(4, [bi, ni, ki] if transposed else [bi, ki, ni]),
            b.amap(4, [bi, mi, ni])]
    init = b.filled((batch, mm, nn), DType.I32, b.ci(0, 32))

    def body(p: ir.Value, q: ir.Value, acc: ir.Value) -> ir.Value:
        return arith.addi(acc, arith.muli(b.widen(p, DType.U8, 32), b.widen(q, DType.I8, 32)))

    accv = b.generic([a3.value, b3.value], [DType.U8, DType.I8], (batch, mm, nn), [DType.I32],
                     maps, ["parallel"] * 3 + ["reduction"], body, inits=[init])[0]
    if em.opts.cpu_strategies:
        accv.owner.attributes["compilation_info"] = _batch_gemm_config(mm, nn, kk)
    acc = TV(accv, DType.I32, (batch, mm, nn))
    sums: list[TV] = []                   # over K, broadcastable: [batch, M, 1], [batch, 1, N]
    factors: list[int] = []
    if zb:
        sums.append(_k_sums(a3, 2, (batch, mm, 1)))
        factors.append(-zb)
    if za:
        sums.append(_k_sums(b3, 2 if transposed else 1, (batch, 1, nn)))
        factors.append(-za)
    const = (kk * za * zb + 2**31) % 2**32 - 2**31     # wrapped to i32 like the sums
    if sums or const:
        def fix(acc_v: ir.Value, *args: ir.Value) -> ir.Value:
            for f, s_v in zip(factors, args[:-1], strict=True):     # args[-1]: the out value
                acc_v = arith.addi(acc_v, arith.muli(s_v, b.ci(f, 32)))
            return arith.addi(acc_v, b.ci(const, 32)) if const else acc_v

        acc = b.elementwise([acc, *sums], acc.shape, DType.I32, fix)
    return b.reshape(acc, out)


# tiles of the batch GEMM (batch, M, N, K): workgroup, vector and reduction levels; measured on
# BERT-base attention (128×128×64 per head, 2 threads): 4×16 vector tiles with K steps of 16
# took the P·V and Q·Kᵀ dispatches from 25-35 GOPS (IREE's default) to ~75
_BATCH_GEMM_TILES = ((1, 64, 64, 0), (1, 4, 16, 0), (0, 0, 0, 16))


def _batch_gemm_config(m: int, n: int, k: int) -> ir.Attribute:
    """A preset ``compilation_info`` for the batch GEMM. IREE 3.13's data tiling cannot
    materialize a batched u8 × s8 encoding on the inner-tiled path (it fails to legalize, or
    crashes when a transpose shares the dispatch), and an op with a preset strategy is left out
    of data tiling: the GEMM is tiled and vectorized in place instead."""
    sizes = (1, m, n, k)
    levels = [", ".join(str(min(t, s) if t else 0) for t, s in zip(tiles, sizes, strict=True))
              for tiles in _BATCH_GEMM_TILES]
    return ir.Attribute.parse(
        "#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
        f"distribution = [{levels[0]}], vector_common_parallel = [{levels[1]}], "
        f"vector_reduction = [{levels[2]}]>, translation_info = "
        "#iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _k_sums(x: TV, k_axis: int, shape: tuple[int, int, int]) -> TV:
    """Sums of a 3-D GEMM operand over its reduction axis ``k_axis`` (1 or 2), widened to i32,
    kept broadcastable as ``shape`` (``[batch, M, 1]`` or ``[batch, 1, N]``)."""
    d = b.dims(3)
    bi, ri, ki = d
    in_exprs = [bi, ri, ki] if k_axis == 2 else [bi, ki, ri]
    flat = (x.shape[0], x.shape[3 - k_axis])
    init = b.filled(flat, DType.I32, b.ci(0, 32))

    def body(p: ir.Value, acc: ir.Value) -> ir.Value:
        return arith.addi(acc, b.widen(p, x.dtype, 32))

    res = b.generic([x.value], [x.dtype], flat, [DType.I32],
                    [b.amap(3, in_exprs), b.amap(3, [bi, ri])],
                    ["parallel", "parallel", "reduction"], body, inits=[init])
    return b.reshape(TV(res[0], DType.I32, flat), shape)


@emits(Op.QMUL)
def _qmul(em: Emitter, n: Node, v: list[Value]) -> Value:
    x, y = materialize(v[0]), materialize(v[1])
    za, zb = n.attrs.a_zp, n.attrs.b_zp

    def body(p: ir.Value, q: ir.Value, _o: ir.Value) -> ir.Value:
        return arith.muli(arith.subi(b.widen(p, x.dtype, 32), b.ci(za, 32)),
                          arith.subi(b.widen(q, y.dtype, 32), b.ci(zb, 32)))

    return b.elementwise([x, y], n.shape, DType.I32, body)


@emits(Op.QSUM)
def _qsum(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    zp = n.attrs.x_zp
    red = {dd % len(x.shape) for dd in n.attrs.dims}
    d = b.dims(len(x.shape))
    kept = [d[i] if i not in red else 0 for i in range(len(x.shape))]
    o_exprs = kept if n.attrs.keepdim else [d[i] for i in range(len(x.shape)) if i not in red]
    init = b.filled(n.shape, DType.I32, b.ci(0, 32))
    iters = ["reduction" if i in red else "parallel" for i in range(len(x.shape))]

    def body(a: ir.Value, acc: ir.Value) -> ir.Value:
        return arith.addi(acc, arith.subi(b.widen(a, x.dtype, 32), b.ci(zp, 32)))

    res = b.generic([x.value], [x.dtype], n.shape, [DType.I32],
                    [b.identity(len(x.shape)), b.amap(len(x.shape), o_exprs)], iters, body,
                    inits=[init])
    return TV(res[0], DType.I32, n.shape)


def pool(em: Emitter, n: Node, x: TV, pad_value: ir.Value, out_dtype: DType, combine,
         pre=None, post=None) -> TV:  # type: ignore[no-untyped-def]
    """A pooling window (NHWC or NCHW) as one elementwise generic over the KH·KW strided slices
    of the padded input: IREE vectorizes it along channels (a window-reduction generic it does
    not: 4.6x slower on resnet18's stem pool). ``pre`` maps each element, ``combine`` folds two
    mapped elements, ``post`` finishes."""
    a = n.attrs
    (ph, pw), (sh, sw) = a.padding, a.stride
    (dh, dw) = a.get("dilation", (1, 1))
    hd, wd = (1, 2) if a.get("layout") == "nhwc" else (2, 3)
    before, strides = [0] * 4, [1] * 4
    before[hd], before[wd] = ph, pw
    strides[hd], strides[wd] = sh, sw
    from qcompile.codegen.emit_ukernel import prepadded

    # a max pool reads a microkernel conv's output in place, bordered with the u8 minimum
    bordered = prepadded(em, n, (ph, pw), DType.U8.range[0]) if \
        n.op is Op.MAXPOOL2D and hd == 1 and x.dtype is DType.U8 else None
    if bordered is not None:
        xp = bordered
    else:
        with em.loc(n, ".copy"):
            xp = b.pad(x, before, before, pad_value)
    parts = []
    for i in range(a.kernel[0]):
        for j in range(a.kernel[1]):
            offsets = [0] * 4
            offsets[hd], offsets[wd] = i * dh, j * dw
            parts.append(b.extract_slice(xp, offsets, n.shape, strides))

    def body(*args: ir.Value) -> ir.Value:
        mapped = [pre(v) if pre else v for v in args[:-1]]
        out = mapped[0]
        for other in mapped[1:]:
            out = combine(out, other)
        return post(out) if post else out

    return b.elementwise(parts, n.shape, out_dtype, body)


@emits(Op.QSUMPOOL2D)
def _qsumpool(em: Emitter, n: Node, v: list[Value]) -> Value:
    """Window sums of ``x - zp`` (padding holds the zero point, so it adds nothing)."""
    x = materialize(v[0])
    zp = n.attrs.x_zp
    return pool(em, n, x, b.ci(zp, 8), DType.I32, arith.addi,
                pre=lambda xv: arith.subi(b.widen(xv, x.dtype, 32), b.ci(zp, 32)))


@emits(Op.MAXPOOL2D)
def _maxpool(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    if x.dtype is DType.F32:
        return pool(em, n, x, b.cf(float("-inf")), x.dtype, arith.maximumf)
    combine = arith.maxui if x.dtype is DType.U8 else arith.maxsi
    return pool(em, n, x, b.ci(x.dtype.range[0], 8), x.dtype, combine)

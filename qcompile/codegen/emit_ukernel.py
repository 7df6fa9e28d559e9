r"""Conv chains lowered to the AVX-512 VNNI microkernel (:mod:`qcompile.codegen.ukernel`).

::

    x_i8/u8  W_s8  bias_i32                      x_u8 (padded by zp, C rounded up to 4)
        \     |     /                                 |   W packed  params (bias', M, shift)
        QCONV2D (NHWC, groups 1) -> i32                |  /         /
              |            [res_i8/u8]     ==>    flow.dispatch @qk_conv_<conv>_<rq>  -> int8
        REQUANT (per-channel M, shift, clamp)         (implicit GEMM + fused requantize)

The conv emitter returns a :class:`~qcompile.codegen.mlir_emit.Pending` for the chains that
:func:`plan` selects, and the requant emitter calls :func:`emit` in its place. In the MLIR
module the dispatch is a ``func.call`` of a private declaration (``@qk_conv_<conv>_<rq>``), so
the module verifies with the bindings; :func:`link` turns each declaration into its
``hal.executable`` (the target string and the object path depend on the iree-compile flags) and
each call into a ``flow.dispatch``. Everything else in the chain (bias with the folded zero
points, per-channel fixed-point multiplier and shift, residual term, clamp) is computed by the
kernel exactly as :func:`qcompile.ir.qmath.requantize`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, func

from qcompile.codegen import builder as b
from qcompile.codegen import ukernel
from qcompile.codegen.builder import TV
from qcompile.codegen.fusions import Attention, scalar_requant, table_reader
from qcompile.codegen.fusions import attention_chains as find_attention
from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType

if TYPE_CHECKING:
    from qcompile.codegen.mlir_emit import Emitter, Pending

PREFIX = "qk_conv_"            # conv chains; linear and matmul chains: MATMUL_PREFIX
MATMUL_PREFIX = "qk_matmul_"
QUANT_PREFIX = "qk_quant_"     # the model input's quantize into a conv's padded input
MULTI_PREFIX = "qk_mlin_"      # linears sharing their input, one dispatch
ATTN_PREFIX = "qk_attn_"       # Q·Kᵀ → requantize → mask → softmax → P·V → requantize


@dataclass(frozen=True)
class UkCall:
    """One microkernel dispatch of a module (what :func:`link` needs to write its executable)."""

    name: str
    shape: ukernel.ConvShape
    nparams: int
    nweights: int
    residual: bool
    loc: str | None = None           # the contraction's source location
    matmul: bool = False             # a batched matmul of two run-time operands
    narrow: bool = False             # requantized with 32-bit lanes (pack_params)
    quantize: ukernel.QuantizeShape | None = None   # an input quantize (qk_quantize_nchw)
    multi: tuple[int, int] | None = None    # linears sharing their input: (blocks, output size)
    members: tuple[str | None, ...] = ()    # their locations (one chain each)
    floating: bool = False           # a dequantize: f32 out (and f32 residual)
    lut: bool = False                # stores the table of the elementwise op that follows
    depthwise: bool = False          # a depthwise conv (qk_dwconv_u8s8)
    attention: ukernel.AttentionShape | None = None   # a fused attention (qk_attention_u8)
    nmask: int = 0                   # its mask operand's elements

    @property
    def locs(self) -> tuple[str | None, ...]:
        """The source locations of the chains this call computes."""
        return self.members or (self.loc,)


def why_not(conv: Node, users: dict[int, list[Node]]) -> str | None:
    """``None`` when the chain ``conv → requant`` (a conv, or a linear as a 1×1 conv) maps onto
    the microkernel, else the reason."""
    a = conv.attrs
    if conv.op is Op.QCONV2D:
        if a.get("layout") != "nhwc":
            return "NCHW conv"
        if a.groups != 1:
            c = conv.src[0].shape[-1]
            if not a.groups == c == conv.shape[-1]:
                return "grouped conv"
            kw = np.asarray(conv.src[1].attrs.value).shape[2]
            why = ukernel.depthwise_fits(c, kw, tuple(a.stride), tuple(a.dilation))
            if why is not None:
                return why
            rq = users.get(id(conv), [None])[0]
            if rq is not None and rq.op is Op.REQUANT and len(rq.src) > 1:
                return "depthwise conv with a residual"
    if conv.op is Op.QMATMUL and not (
            conv.src[0].shape[:-2] == conv.src[1].shape[:-2] == conv.shape[:-2]):
        return "broadcast batch dims"
    readers = users.get(id(conv), [])
    if len(readers) != 1:
        return f"i32 accumulator with {len(readers)} readers"
    rq = readers[0]
    if rq.op is Op.DEQUANT and conv.op is Op.QLINEAR:
        qp = rq.attrs.qp
        if rq.src[0] is not conv or qp.axis not in (None, len(rq.shape) - 1):
            return "dequantize is not per output channel"
        return None
    if rq.op is not Op.REQUANT:
        return f"epilogue is {rq.op.value}, not a requantize"
    if rq.src[0] is not conv or conv in rq.src[1:]:
        return "accumulator is not the requantize's first term"
    if len(rq.src) > 2:
        return "more than one residual term"
    if len(rq.src) == 2 and conv.op is Op.QMATMUL:
        return "a matmul with a residual"
    if len(rq.src) == 2 and (not rq.src[1].dtype.is_int8 or rq.src[1].shape != rq.shape):
        return "residual term is not an int8 tensor of the output's shape"
    r = rq.attrs.rq
    if r.axis not in (None, len(rq.shape) - 1) or not r.out_dtype.is_int8 or min(r.shift) < 1:
        return "requantize is not per output channel onto int8"
    # no shape is excluded: on the 21 measured conv shapes of resnet18/resnet50/mobilenet_v2 the
    # kernel was never slower than the stock lowering (1 thread 1.07-2.7x, 2 threads 1.0-3.5x;
    # qcompile/codegen/ukernel/README.md)
    return None


def plan(graph: Graph, users: dict[int, list[Node]]) -> tuple[dict[int, Node], dict[str, int]]:
    """``id(conv or linear) -> requant`` of the chains to lower, and the count of each reason
    (``"conv: …"``, ``"linear: …"``) for the contractions that keep the stock lowering."""
    chosen: dict[int, Node] = {}
    stock: dict[str, int] = {}
    outputs = {id(o) for o in graph.outputs}
    for n in graph.nodes():
        if n.op not in (Op.QCONV2D, Op.QLINEAR, Op.QMATMUL):
            continue
        why = "i32 accumulator is a graph output" if id(n) in outputs else why_not(n, users)
        if why is None:
            chosen[id(n)] = users[id(n)][0]
        else:
            key = f"{n.op.value.removeprefix('q').removesuffix('2d')}: {why}"
            stock[key] = stock.get(key, 0) + 1
    return chosen, stock


def linear_groups(graph: Graph, chosen: dict[int, Node], users: dict[int, list[Node]]
                  ) -> dict[int, tuple[Node, ...]]:
    """``id(linear) -> the linears it shares one dispatch with``: microkernel linear chains
    that read the same tensor with the same zero point and K, without a residual and onto the
    same int8 type (attention's q, k and v projections), in graph order."""
    by_input: dict[tuple[int, int], list[Node]] = {}
    for n in graph.nodes():
        if n.op is not Op.QLINEAR or id(n) not in chosen or len(chosen[id(n)].src) != 1 or \
                chosen[id(n)].op is not Op.REQUANT:
            continue
        key = (id(n.src[0]), int(n.attrs.x_zp))
        by_input.setdefault(key, []).append(n)
    out: dict[int, tuple[Node, ...]] = {}
    for lins in by_input.values():
        dtypes = {chosen[id(n)].dtype for n in lins}
        if len(lins) > 1 and len(dtypes) == 1:
            for n in lins:
                out[id(n)] = tuple(lins)
    return out


def float_residuals(graph: Graph, chosen: dict[int, Node], users: dict[int, list[Node]]
                    ) -> dict[int, tuple[Node, Node]]:
    """``id(dequantize) -> (add, residual)``: the float add that is a microkernel dequantize's
    only reader (a residual stream kept float, ``x + dequant(linear(...))``), when its other
    operand is an f32 tensor of the same shape computed before the dequantize: the kernel adds
    it in its epilogue and writes the sum."""
    order = {id(n): k for k, n in enumerate(graph.nodes())}
    outputs = {id(o) for o in graph.outputs}
    out: dict[int, tuple[Node, Node]] = {}
    for dq in chosen.values():
        readers = users.get(id(dq), [])
        if dq.op is not Op.DEQUANT or len(readers) != 1 or id(dq) in outputs:
            continue
        add = readers[0]
        if add.op is not Op.ADD or add.dtype is not DType.F32 or add.shape != dq.shape or \
                len(add.src) != 2 or add.src[0] is add.src[1]:
            continue
        other = add.src[1] if add.src[0] is dq else add.src[0]
        if other.dtype is DType.F32 and other.shape == add.shape and \
                order[id(other)] < order[id(dq)]:
            out[id(dq)] = (add, other)
    return out


def attention_chains(graph: Graph, users: dict[int, list[Node]]
                     ) -> tuple[dict[int, Attention], dict[str, int]]:
    """The attention chains the fused kernel computes (:func:`qcompile.codegen.fusions.
    attention_chains` within the kernel's stack limits)."""
    return find_attention(graph, users, ukernel.attention_fits)


def emit_attention(em: Emitter, att: Attention) -> TV:
    """The fused attention dispatch of ``att``; its result is the head merge's value (set for
    both merge nodes)."""
    from qcompile.codegen.mlir_emit import materialize

    nb, h, s, d = att.qk.src[0].shape
    mask = att.mask.src[1] if att.mask is not None else None
    shape = ukernel.AttentionShape(nb, s, h, d, mask.shape[0] if mask is not None else 0)
    qa, pa = att.qk.attrs, att.pv.attrs
    flips = (att.q.dtype is DType.I8, att.k.dtype is DType.U8, att.v.dtype is DType.U8)
    zps = (int(qa.a_zp) + 128 * flips[0], int(qa.b_zp) - 128 * flips[1],
           int(pa.b_zp) - 128 * flips[2], int(pa.a_zp))
    sa = att.softmax.attrs
    lo = att.rq1.dtype.range[0]
    params = ukernel.pack_attention_params(
        shape, flips, zps, lo, scalar_requant(att.rq1),
        (int(sa.m), int(sa.zp), *map(int, sa.range)), scalar_requant(att.rq2),
        np.asarray(att.mask.attrs.table) if att.mask is not None else None, np.asarray(sa.table),
        scores_signed=att.softmax.src[0].dtype is DType.I8)
    ops = [_flat(materialize(em.values[id(x)])) for x in (att.q, att.k, att.v)]
    m = _flat(materialize(em.values[id(mask)])) if mask is not None else \
        b.constant(np.zeros(1, np.int64), DType.I64)
    name = f"{ATTN_PREFIX}{em.ids[id(att.qk)]}_{em.ids[id(att.rq2)]}"
    with em.loc(att.qk):
        out = _call(em, name, [*ops, m, b.constant(params, DType.I64)], shape.size,
                    att.rq2.dtype)
    em.uk_calls.append(UkCall(name, ukernel.ConvShape(nb, 1, s, d, d, 1, 1, 1, 1, 1, 1, 1, s),
                              params.size, 0, False, att.qk.loc, attention=shape,
                              nmask=m.shape[0],
                              members=(att.qk.loc, att.pv.loc)))
    perm, merge = att.merge
    em.values[id(perm)] = b.reshape(out, perm.shape)
    em.values[id(merge)] = b.reshape(out, merge.shape)
    return em.values[id(merge)]


def emit_dequant(em: Emitter, dq: Node, pending: Pending) -> TV:
    """The microkernel dispatch of ``linear → dequantize`` (f32 out,
    ``qmath.dequantize_array``), with the float add of :func:`float_residuals` fused: then the
    add's value is set too (the dequantize's only reader)."""
    from qcompile.codegen.emit_contract import as_u8, folded_bias
    from qcompile.codegen.mlir_emit import materialize
    from qcompile.ir import qmath

    lin, qp = dq.src[0], dq.attrs.qp
    x, zp = as_u8(pending.x, lin.attrs.x_zp)
    xp, w, s = _linear_operands(em, lin, x, zp)
    nn = s.f
    m, power = qmath.scale_fixed(np.broadcast_to(np.asarray(qp.scale, np.float64), (nn,)))
    bias = folded_bias(np.asarray(lin.src[2].attrs.value), w, zp, lin) - \
        np.broadcast_to(np.asarray(qp.zero_point, np.int64), (nn,))
    fused = em.uk_float_add.get(id(dq))
    params = ukernel.pack_params(s, bias, m, np.ones(nn, np.int64), 0, 0, 0,
                                 dequant_scale=power, float_residual=fused is not None)
    operands = [_flat(xp), b.constant(ukernel.pack_weights(w), DType.I8),
                b.constant(params, DType.I64)]
    if fused is not None:
        operands.append(_flat(materialize(em.values[id(fused[1])])))
    name = f"{MATMUL_PREFIX}{em.ids[id(lin)]}_{em.ids[id(dq)]}"
    out = b.reshape(_call(em, name, operands, s.out_size, DType.F32), dq.shape)
    em.uk_calls.append(UkCall(name, s, params.size, operands[1].shape[0], fused is not None,
                              lin.loc, floating=True))
    if fused is not None:
        em.values[id(fused[0])] = out
    return out


def _flat(x: TV) -> TV:
    return b.reshape(x, (int(np.prod(x.shape)),))


def emit(em: Emitter, rq_node: Node, pending: Pending, res: TV | None) -> TV:
    """The microkernel dispatch of the chain ``rq_node.src[0] → rq_node`` on the contraction's
    operands ``pending`` with the residual operand ``res``."""
    from qcompile.codegen.emit_contract import _weights_ohwi, as_u8, folded_bias

    conv = rq_node.src[0]
    a, rq = conv.attrs, rq_node.attrs.rq
    if conv.op is Op.QMATMUL:
        assert pending.y is not None
        return _emit_matmul(em, rq_node, pending.x, pending.y)
    x, zp = as_u8(pending.x, a.x_zp)
    if conv.op is Op.QLINEAR and id(conv) in em.uk_groups:
        if id(rq_node) not in em.uk_group_out:
            _emit_linear_group(em, em.uk_groups[id(conv)], x, zp)
        return em.uk_group_out[id(rq_node)]
    if conv.op is Op.QLINEAR:
        xp, w, s = _linear_operands(em, conv, x, zp)
    else:
        w = _weights_ohwi(conv)
        f, kh, kw, c = w.shape
        nb, h, wd, cx = x.shape
        (ph, pw), (sh, sw), (dh, dw) = a.padding, a.stride, a.dilation
        depthwise = a.groups != 1          # why_not: groups == C == F
        c = cx if depthwise else c     # input channels
        cp = ukernel.padded_channels(c)
        pre = prepadded(em, conv, (ph, pw), int(a.x_zp))
        inner = in_place(em, conv) if cp == c and not depthwise else None
        x_off = xstep = 0
        if pre is not None and cp == c:
            xp = pre
        elif inner is not None:
            # a conv without padding reads another conv's padded output in place: the kernel
            # starts at the first interior element and steps over the border rows and columns
            xp, (pt, pl) = inner
            x_off = (pt * (wd + 2 * pl) + pl) * cp
            ph, pw = pt, pl
        elif (qin := _input_quantize(em, conv)) is not None:
            packed = not depthwise and ukernel.packed_stem(c, kw, wd, dw)
            xp = _emit_input_quantize(em, conv, qin, (ph, pw), packed)
            if packed:          # one column over each kernel row's bytes (ConvShape.xstep)
                w = w.reshape(f, kh, 1, kw * c)
                xstep, cp, kw, dw = c, ukernel.padded_channels(kw * c), 1, 1
        else:
            with em.loc(conv, ".copy"):
                xp = b.pad(x, [0, ph, pw, 0], [0, ph, pw, cp - c], b.ci(zp, 8))
        s = ukernel.ConvShape(nb, h + 2 * ph, wd + 2 * pw, cp, f, kh, kw, sh, sw, dh, dw,
                              rq_node.shape[1], rq_node.shape[2], depthwise=depthwise,
                              x_off=x_off, xstep=xstep,
                              pair=ukernel.pairs_fit(f, depthwise))
    if conv.op is Op.QCONV2D and em.opts.winograd and ukernel.wino_fits(s, w) is None:
        s = replace(s, wino=True)       # exact integer Winograd F(4x4, 3x3) (qk_wino_u8s8)
    # (a depthwise kernel writes no border for its readers)
    border = out_border(em, rq_node) if conv.op is Op.QCONV2D and not s.depthwise else None
    # a table that reads only this requantize: the kernel stores the table's entries
    lut = table_reader(rq_node, em.users, {id(o) for o in em.graph.outputs})
    if border is not None:
        # written straight into its readers' padded input (the kernel writes the border too):
        # no fill and copy of a padded buffer between the dispatches
        s = replace(s, out_pad=border[0], out_fill=border[1])
    res_in = em.prepadded.get(id(rq_node.src[1])) if res is not None else None
    if res_in is not None:
        # the residual read in place from its producer's padded output
        res = res_in[0]
        s = replace(s, res_pad=res_in[1])
    bias = folded_bias(np.asarray(conv.src[2].attrs.value), w, zp, conv) - rq.terms[0].zero_point
    extra: dict[str, Any] = {}
    packed = (ukernel.pack_dw_weights(w[..., 0], (s.sh, s.sw)) if s.depthwise
              else ukernel.pack_wino_weights(w, s.c) if s.wino
              else ukernel.pack_weights(w, s.pair))
    operands = [_flat(xp), b.constant(packed, DType.I8)]
    if res is not None:
        extra = dict(m1=np.asarray(rq.terms[1].multiplier, np.int64),
                     res_zp=rq.terms[1].zero_point, res_signed=res.dtype is DType.I8)
    if lut is not None:
        extra |= dict(lut=np.asarray(lut.attrs.table), lut_lo=rq_node.dtype.range[0])
    params = ukernel.pack_params(s, bias, np.asarray(rq.terms[0].multiplier, np.int64),
                                 np.asarray(rq.shift), rq.zp_out, rq.qmin, rq.qmax, **extra)
    operands.append(b.constant(params, DType.I64))
    if res is not None:
        operands.append(_flat(res))
    prefix = PREFIX if conv.op is Op.QCONV2D else MATMUL_PREFIX
    name = f"{prefix}{em.ids[id(conv)]}_{em.ids[id(rq_node)]}"
    out = _call(em, name, operands, s.out_size, lut.dtype if lut is not None else rq_node.dtype)
    em.uk_calls.append(UkCall(name, s, params.size, operands[1].shape[0], len(operands) == 4,
                              conv.loc, narrow=bool(params[ukernel.H_NARROW]),
                              lut=lut is not None, depthwise=s.depthwise))
    if lut is not None:
        # the kernel stores the table's entries: that is the LUT's value, and the requantize
        # has no reader of its own
        from qcompile.codegen.mlir_emit import Fused

        em.values[id(lut)] = b.reshape(out, lut.shape)
        return Fused(id(rq_node))  # type: ignore[return-value]
    if border is None:
        return b.reshape(out, rq_node.shape)
    pt, pl = s.out_pad
    padded = b.reshape(out, (s.n, s.oh + 2 * pt, s.ow + 2 * pl, s.f))
    em.prepadded[id(rq_node)] = (padded, s.out_pad, s.out_fill)
    return b.extract_slice(padded, [0, pt, pl, 0], list(rq_node.shape), [1, 1, 1, 1])


def _emit_linear_group(em: Emitter, lins: tuple[Node, ...], x: TV, zp: int) -> None:
    """Linears sharing the input ``x`` (u8, zero point ``zp``) as one ``qk_linear_multi``
    dispatch: their packed weights and params back to back behind a directory, the grid's
    channel blocks running over the linears in turn; each requantize's output is a slice of
    the one result (``em.uk_group_out``)."""
    from qcompile.codegen.emit_contract import folded_bias

    xp, _, s0 = _linear_operands(em, lins[0], x, zp)
    head = 1 + ukernel.M_ENTRY * len(lins)
    directory, weights, params = [len(lins)], [], []
    blocks = p_off = w_off = o_off = 0
    slices = []
    for lin in lins:
        rq_node = em.users[id(lin)][0]
        rq = rq_node.attrs.rq
        w = np.asarray(lin.src[1].attrs.value)
        nn = w.shape[0]
        s = replace(s0, f=nn)
        bias = folded_bias(np.asarray(lin.src[2].attrs.value), w, zp, lin) - \
            rq.terms[0].zero_point
        pw = ukernel.pack_weights(w.reshape(nn, 1, 1, -1))
        pp = ukernel.pack_params(s, bias, np.asarray(rq.terms[0].multiplier, np.int64),
                                 np.asarray(rq.shift), rq.zp_out, rq.qmin, rq.qmax)
        directory += [blocks, head + p_off, w_off, o_off]
        weights.append(pw)
        params.append(pp)
        slices.append((rq_node, o_off, s.out_size, bool(pp[ukernel.H_NARROW])))
        blocks += s.blocks
        p_off += pp.size
        w_off += pw.size
        o_off += s.out_size
    dtype = em.users[id(lins[0])][0].dtype
    ids = "_".join(f"{em.ids[id(n)]}_{em.ids[id(em.users[id(n)][0])]}" for n in lins)
    name = f"{MULTI_PREFIX}{ids}"
    all_w = np.concatenate(weights)
    all_p = np.concatenate([np.asarray(directory, np.int64), *params])
    with em.loc(lins[0]):
        out = _call(em, name, [_flat(xp), b.constant(all_w, DType.I8),
                               b.constant(all_p, DType.I64)], o_off, dtype)
    em.uk_calls.append(UkCall(name, s0, all_p.size, all_w.size, False, lins[0].loc,
                              narrow=all(n for *_, n in slices), multi=(blocks, o_off),
                              members=tuple(n.loc for n in lins)))
    for rq_node, off, size, _ in slices:
        piece = b.extract_slice(out, [off], [size], [1])
        em.uk_group_out[id(rq_node)] = b.reshape(piece, rq_node.shape)


def out_border(em: Emitter, rq_node: Node) -> tuple[tuple[int, int], int] | None:
    """The border ``((rows, columns), fill)`` a microkernel conv writes around its output
    ``rq_node`` (u8, not a graph output) so that every reader reads that buffer in place, or
    None. The readers: convs (NHWC) that pad it by the same border with their zero point, or a
    max pool by the same border (its fill is the u8 minimum, 0); besides those, microkernel
    convs without padding (they start inside the border: ``in_place``) and microkernel convs
    whose requantize adds it as their residual (read past the border rows and columns).
    Anything else, or borders that differ, and the output is written bare."""
    readers = em.users.get(id(rq_node), [])
    if not readers or rq_node.dtype is not DType.U8 or \
            any(o is rq_node for o in em.graph.outputs):
        return None
    c = rq_node.shape[-1]
    wants: set[tuple[tuple[int, int], int]] = set()
    for r in readers:
        nhwc = r.attrs.get("layout") == "nhwc"
        if r.op is Op.QCONV2D and nhwc and r.src[0] is rq_node:
            pads = tuple(r.attrs.padding)
            if id(r) in em.uk_chains and c != ukernel.padded_channels(c):
                return None           # the microkernel reads channels padded to 4
            if pads != (0, 0):
                wants.add((pads, int(r.attrs.x_zp)))
            elif id(r) not in em.uk_chains or r.attrs.groups != 1:
                return None
        elif r.op is Op.MAXPOOL2D and nhwc and tuple(r.attrs.padding) != (0, 0):
            wants.add((tuple(r.attrs.padding), DType.U8.range[0]))
        elif not _residual_reader(em, r, rq_node):
            return None
    return wants.pop() if len(wants) == 1 else None


def _residual_reader(em: Emitter, r: Node, x: Node) -> bool:
    """Whether ``r`` is the requantize of a (non-depthwise) microkernel conv that reads ``x``
    only as its residual."""
    if r.op is not Op.REQUANT or len(r.src) != 2 or r.src[1] is not x or r.src[0] is x:
        return False
    conv = r.src[0]
    return conv.op is Op.QCONV2D and em.uk_chains.get(id(conv)) is r and \
        conv.attrs.groups == 1 and conv.src[0] is not x


def in_place(em: Emitter, conv: Node) -> tuple[TV, tuple[int, int]] | None:
    """The padded buffer ``conv`` (no padding of its own) reads its input from, with that
    buffer's border, when its producer wrote one (``out_border``)."""
    got = em.prepadded.get(id(conv.src[0]))
    if got is None or tuple(conv.attrs.padding) != (0, 0):
        return None
    return got[0], got[1]


def _input_quantize(em: Emitter, conv: Node) -> Node | None:
    """The ``quant`` whose NCHW → NHWC permute is ``conv``'s only input path, when the
    microkernel can quantize it straight into the conv's padded input: f32 NCHW with at most 4
    channels, per tensor, u8, both nodes read only here."""
    perm = conv.src[0]
    if perm.op is not Op.PERMUTE or tuple(perm.attrs.dims) != (0, 2, 3, 1) or \
            conv.attrs.get("layout") != "nhwc":
        return None
    quant = perm.src[0]
    qp = quant.attrs.get("qp") if quant.op is Op.QUANT else None
    if qp is None or quant.dtype is not DType.U8 or not qp.per_tensor or \
            quant.src[0].dtype is not DType.F32 or len(quant.shape) != 4 or \
            quant.shape[1] > 4 or int(qp.zero_point[0]) != int(conv.attrs.x_zp):
        return None
    outputs = {id(o) for o in em.graph.outputs}
    if any(len(em.users.get(id(x), [])) != 1 or id(x) in outputs for x in (quant, perm)):
        return None
    return quant


def _emit_input_quantize(em: Emitter, conv: Node, quant: Node, pads: tuple[int, int],
                         packed: bool = False) -> TV:
    """``quant`` (and its permute) as ``qk_quantize_nchw``: the f32 input straight to the u8
    NHWC input of ``conv``, bordered by ``pads`` and its channels padded to 4 with the zero
    point, or ``packed`` rows (C bytes a pixel, flat; the emitted quant and permute are left
    unused)."""
    qp = quant.attrs.qp
    n, c, h, w = quant.shape
    q = ukernel.QuantizeShape(n, c, h, w, *pads, packed=packed)
    zp = int(qp.zero_point[0])
    params = ukernel.pack_quantize_params(q, float(qp.scale[0]), zp, qp.qmin, qp.qmax, zp)
    x = em.values[id(quant.src[0])]
    assert isinstance(x, TV)
    em.uk_checked.add(id(quant.src[0]))     # every value of it passes through the kernel
    name = f"{QUANT_PREFIX}{em.ids[id(quant)]}_{em.ids[id(conv.src[0])]}"   # quant, permute
    with em.loc(quant):
        out = _call(em, name, [_flat(x), b.constant(params, DType.I64)], q.out_size, DType.U8)
    em.uk_calls.append(UkCall(name, ukernel.ConvShape(n, h + 2 * pads[0], w + 2 * pads[1], 4, 4,
                                                      1, 1, 1, 1, 1, 1, h, w),
                              params.size, 0, False, quant.loc, quantize=q))
    return out if packed else b.reshape(out, (n, h + 2 * pads[0], w + 2 * pads[1], 4))


def prepadded(em: Emitter, reader: Node, pads: tuple[int, int], fill: int) -> TV | None:
    """``reader``'s input as the microkernel already wrote it, bordered by ``pads`` filled with
    ``fill`` (:func:`out_border`), or None."""
    got = em.prepadded.get(id(reader.src[0]))
    return got[0] if got is not None and got[1:] == (tuple(pads), fill) else None


# output pixels per kernel row when a linear runs as a 1×1 conv: its M rows are split into
# rows of at most this many (a divisor of M), so that the workgroup grid has rows to share out
LINEAR_ROW = 128


def _rows(m: int) -> tuple[int, int]:
    """``M`` GEMM rows as ``(kernel rows, pixels per row)``."""
    ow = max(d for d in range(1, min(m, LINEAR_ROW) + 1) if m % d == 0)
    return m // ow, ow


def _emit_matmul(em: Emitter, rq_node: Node, x: TV, y: TV) -> TV:
    """``sum (a - za)(b - zb)`` per batch as the kernel's GEMM of ``a`` (u8) with ``b`` flipped
    to s8 (``b' = b - 128``) and packed per image at run time, plus the terms
    ``-zb' rowsum(a)`` (per pixel) and ``-za colsum(b') + K za zb'`` (per channel), exact in
    wrapping i32 like the stock form. A ``b`` transposed from ``[..., N, K]`` is packed from
    that source."""
    from qcompile.codegen.emit_contract import _k_sums, _transposed_source, as_s8, as_u8

    mm, rq = rq_node.src[0], rq_node.attrs.rq
    out = mm.shape
    bt = int(np.prod(out[:-2], dtype=np.int64))
    m, k, nn = x.shape[-2], x.shape[-1], out[-1]
    a, za = as_u8(x, mm.attrs.a_zp)
    yt = _transposed_source(em, mm.src[1])
    bs, zb = as_s8(yt if yt is not None else y, mm.attrs.b_zp)
    a3 = b.reshape(a, (bt, m, k))
    bnk = b.reshape(bs, (bt, nn, k)) if yt is not None else \
        b.transpose(b.reshape(bs, (bt, k, nn)), (0, 2, 1))
    kp, oh, ow = ukernel.padded_channels(k), *_rows(m)
    fp = -(-nn // ukernel.BLOCK) * ukernel.BLOCK              # every block 64 channels wide
    s = ukernel.ConvShape(bt, oh, ow, kp, nn, 1, 1, 1, 1, 1, 1, oh, ow, wstride=fp * kp,
                          f_round=ukernel.BLOCK)
    with em.loc(mm, ".copy"):
        xp = b.pad(b.reshape(a3, (bt, oh, ow, k)), [0] * 4, [0, 0, 0, kp - k], b.ci(za, 8))
        wp = b.pad(bnk, [0] * 3, [0, s.fp - nn, kp - k], b.ci(0, 8))
        wp = b.transpose(b.reshape(wp, (bt, s.fp // ukernel.BLOCK, ukernel.BLOCK, kp // 4, 4)),
                         (0, 1, 3, 2, 4))
    const = (k * za * zb + 2**31) % 2**32 - 2**31      # wrapped to i32 like the sums

    def scaled(sums: TV, f: int, c: int) -> TV:
        return b.elementwise([sums], sums.shape, DType.I32, lambda v, _o: arith.addi(
            arith.muli(v, b.ci(f, 32)), b.ci(c, 32)))

    rowt = scaled(b.reshape(_k_sums(a3, 2, (bt, m, 1)), (bt * m,)), -zb, 0)
    colt = scaled(b.reshape(_k_sums(bnk, 2, (bt, nn, 1)), (bt, nn)), -za, const)
    colt = b.pad(colt, [0, 0], [0, s.fp - nn], b.ci(0, 32))
    terms = b.filled((bt * (m + s.fp),), DType.I32, b.ci(0, 32))
    terms = TV(terms, DType.I32, (bt * (m + s.fp),))
    terms = b.insert_slice(rowt, terms, [0], [bt * m])
    terms = b.insert_slice(_flat(colt), terms, [bt * m], [bt * s.fp])
    bias = np.full(nn, -rq.terms[0].zero_point, np.int64)
    # |sum (a - za)(b' - zb')| <= K * 255 * 255: the accumulator with both terms added
    params = ukernel.pack_params(s, bias, np.asarray(rq.terms[0].multiplier, np.int64),
                                 np.asarray(rq.shift), rq.zp_out, rq.qmin, rq.qmax,
                                 acc_bound=kp * 255 * 255)
    operands = [_flat(xp), _flat(wp), b.constant(params, DType.I64), terms]
    name = f"{MATMUL_PREFIX}{em.ids[id(mm)]}_{em.ids[id(rq_node)]}"
    y8 = _call(em, name, operands, bt * m * nn, rq_node.dtype)
    em.uk_calls.append(UkCall(name, s, params.size, bt * s.fp * kp, False, mm.loc, matmul=True,
                              narrow=bool(params[ukernel.H_NARROW])))
    return b.reshape(y8, rq_node.shape)


def _linear_operands(em: Emitter, lin: Node, x: TV, zp: int
                     ) -> tuple[TV, np.ndarray, ukernel.ConvShape]:
    """A linear ``x[..., K] · W[N, K]ᵀ`` as a 1×1 conv over an image of its ``M`` rows:
    ``[1, M / ow, ow, K]`` (K padded by the zero point to a multiple of 4), weights OHWI."""
    w = np.asarray(lin.src[1].attrs.value)
    nn, k = w.shape
    oh, ow = _rows(int(np.prod(x.shape[:-1])))
    cp = ukernel.padded_channels(k)
    xp = b.reshape(x, (1, oh, ow, k))
    if cp != k:
        with em.loc(lin, ".copy"):
            xp = b.pad(xp, [0, 0, 0, 0], [0, 0, 0, cp - k], b.ci(zp, 8))
    s = ukernel.ConvShape(1, oh, ow, cp, nn, 1, 1, 1, 1, 1, 1, oh, ow)
    return xp, w.reshape(nn, 1, 1, k), s


def _call(em: Emitter, name: str, operands: Sequence[TV], size: int, dtype: DType) -> TV:
    """``func.call`` of a private declaration ``name`` (replaced by :func:`link`)."""
    out_t = b.tensor_type((size,), dtype)
    assert em.module is not None
    with ir.InsertionPoint(em.module.body):
        func.FuncOp(name, ([o.value.type for o in operands], [out_t]), visibility="private")
    call = func.CallOp([out_t], ir.FlatSymbolRefAttr.get(name), [o.value for o in operands])
    return TV(call.results[0], dtype, (size,))


_PREFIXES = "|".join((PREFIX, MATMUL_PREFIX, QUANT_PREFIX, MULTI_PREFIX, ATTN_PREFIX))
_NAMES = rf"(?:{_PREFIXES})\d+(?:_\d+)+"
_DECL = re.compile(rf"^ *func\.func private @({_NAMES})\(.*$", re.M)
_CALL = re.compile(rf"\b(?:func\.)?call @({_NAMES})\(")


def link(text: str, calls: Sequence[UkCall], obj: Path, target: str,
         pooled: bool = False) -> str:
    """``text`` with each microkernel declaration replaced by its ``hal.executable`` (variant
    target ``target``, object ``obj``) and each call by a ``flow.dispatch``.

    ``pooled``: every dispatch shares its workgroups out over qcompile's thread pool
    (:mod:`qcompile.codegen.ukernel.pool`), which ``main`` takes as one more argument
    (:data:`POOL_ARG`, ``tensor<CTX_SIZExi64>``). Then come the caller's storage for each
    result (``iree.abi.output``) and for the transients (``iree.abi.transients``, a
    ``!hal.buffer``): the call then allocates nothing, awaits no allocation, and IREE's
    ``local-sync`` device runs each dispatch as it is recorded (an inline command buffer)
    instead of recording all of them and then replaying them (:class:`iree_cpu.Module`)."""
    from qcompile.errors import CompileError

    by_name = {c.name: c for c in calls}

    def executable(m: re.Match[str]) -> str:
        c = by_name[m.group(1)]
        if c.quantize is not None:
            return ukernel.quantize_executable_mlir(c.name, obj, c.quantize, c.nparams, target,
                                                    entry=c.name, pooled=pooled)
        if c.attention is not None:
            return ukernel.attention_executable_mlir(c.name, obj, c.attention, c.nmask,
                                                     c.nparams, target, entry=c.name,
                                                     pooled=pooled)
        if c.multi is not None:
            return ukernel.multi_executable_mlir(c.name, obj, c.shape, c.nweights, c.nparams,
                                                 c.multi[1], c.multi[0], target, entry=c.name,
                                                 pooled=pooled)
        return ukernel.executable_mlir(c.name, obj, c.shape, c.nparams, c.nweights, c.residual,
                                       target, entry=c.name, matmul=c.matmul,
                                       floating=c.floating, pooled=pooled)

    text = _DECL.sub(executable, text)
    if not pooled:
        return _CALL.sub(lambda m: f"flow.dispatch @{m.group(1)}::@x86::@{m.group(1)}(", text)
    ctx_t = f"tensor<{ukernel.CTX_SIZE}xi64>"
    text = _POOLED_CALL.sub(
        lambda m: (f"flow.dispatch @{m.group(1)}::@x86::@{m.group(1)}({m.group(2)}, "
                   f"%{POOL_ARG}) : ({m.group(3)}, {ctx_t})"), text)
    if (left := _CALL.search(text)) is not None:
        raise CompileError("cpu: a microkernel call has an unexpected form", why=left.group(0),
                           next="compile with QCOMPILE_POOL=0 and report this model")
    head = re.search(r"func\.func @main\(", text)
    if head is None:
        raise CompileError("cpu: the module has no main function to add the pool argument to")
    depth, i = 1, head.end()
    while depth:                  # the argument list's closing parenthesis (locs nest)
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    close = i - 1
    sep = "" if text[head.end():close].strip() == "" else ", "
    results = re.match(r"\s*->\s*(\([^{]*\)|tensor<[^>]*>)\s*(?:attributes\b[^{]*)?\{",
                       text[i:])
    if results is None:
        raise CompileError("cpu: main's results have an unexpected form",
                           why=text[i:i + 200], next="compile with QCOMPILE_POOL=0 and report "
                                                     "this model")
    storage = "".join(f", %{OUT_ARG}{k}: {t} {{iree.abi.output = {k} : index}}"
                      for k, t in enumerate(re.findall(r"tensor<[^>]*>", results.group(1))))
    return (f"{text[:close]}{sep}%{POOL_ARG}: {ctx_t}{storage}, "
            f"%{TRANSIENTS_ARG}: !hal.buffer {{iree.abi.transients}}{text[close:]}")


_POOLED_CALL = re.compile(rf"\b(?:func\.)?call @({_NAMES})\(([^()]*)\) : \(([^()]*)\)")
POOL_ARG = "qk_pool"
OUT_ARG = "qk_out"                 # OUT_ARG0, ...: the results' storage
TRANSIENTS_ARG = "qk_transients"


@dataclass(frozen=True)
class Support:
    """Whether this compile lowers conv chains to the microkernel: its object, or why not."""

    obj: Path | None
    why: str


def support(wanted: bool | None) -> Support:
    """``wanted`` None: on when the host has AVX-512 VNNI and gcc builds the kernel."""
    from qcompile.errors import CompileError

    if wanted is False:
        return Support(None, "off (compile option ukernel_convs: false)")
    if not ukernel.host_has_vnni():
        return Support(None, "the host CPU has no AVX-512 VNNI (avx512f/bw/dq/vl, avx512_vnni)")
    try:
        obj = ukernel.build_object()
    except CompileError as err:
        return Support(None, f"{err.what}: {err.why}" if err.why else err.what)
    return Support(obj, f"AVX-512 VNNI host, kernel built by gcc ({obj.name})")

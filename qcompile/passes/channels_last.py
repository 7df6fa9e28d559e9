r"""channels-last

    x_q u8[N,C,H,W]                               x_q ──PERMUTE(0,2,3,1)──▶ u8[N,H,W,C]  (once)
        |                                                          |
    QCONV2D {layout=nchw}  W i8[F,C/g,KH,KW]        QCONV2D {layout=nhwc}  W i8[F,KH,KW,C/g]
        |  i32[N,F,OH,OW]                   ==>                    |  i32[N,OH,OW,F]
    REQUANT {axis=1} / LUT / QMUL / PAD / CAT                REQUANT {axis=3} / LUT / QMUL / ...
        |                                                          |
    MAXPOOL2D / QSUMPOOL2D / QSUM(keepdim)          MAXPOOL2D / QSUMPOOL2D {layout=nhwc} / QSUM
        |                                                          |
    RESHAPE (flatten) ──▶ QLINEAR                   RESHAPE (H=W=1) or PERMUTE(0,3,1,2) ──▶ ...

Convolutions and pools run channels-last (the layout the int8 dot-product instructions want: C is
the contiguous reduction axis). Integer ops between them follow their operands; every other op
keeps NCHW. Layout changes appear only at the edges of the NHWC region, at most one per tensor and
direction; one that moves only size-1 dims is a RESHAPE, and a model's own reshape or permute of an
NHWC tensor absorbs it. Inserted changes carry ``layout`` (the layout of their result), so the
region can be recovered from the graph (:func:`nhwc_values`). Graph outputs keep their layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from qcompile.ir.graph import Attrs, Graph, Node, Op
from qcompile.passes.base import Pass

TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)
POS = {d: TO_NHWC.index(d) for d in range(4)}   # NCHW axis -> its position in NHWC
SPATIAL = frozenset({Op.QCONV2D, Op.QSUMPOOL2D, Op.MAXPOOL2D})
FOLLOWERS = frozenset({Op.REQUANT, Op.LUT, Op.QMUL, Op.PAD, Op.CAT, Op.DEQUANT, Op.QSUM})


class ChannelsLast(Pass):
    name = "channels-last"

    def run(self, g: Graph) -> tuple[Graph, int]:
        if not any(_relayable(n) and n.op is Op.QCONV2D for n in g.nodes()):
            return g, 0   # no int8 convolution: nothing gains from NHWC
        r = _Relayout()
        for n in g.nodes():
            r.visit(n)
        outputs = tuple(r.nchw(r.memo[id(o)]) for o in g.outputs)
        return Graph(g.name, g.inputs, outputs), r.fired


def _relayable(n: Node) -> bool:
    """An int8 convolution or pool still in NCHW."""
    if n.op not in SPATIAL or len(n.shape) != 4 or n.attrs.get("layout", "nchw") != "nchw":
        return False
    return n.op is not Op.MAXPOOL2D or n.dtype.is_int8


def permuted(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[d] for d in dims)


class _Relayout:
    """One rebuild in topological order: ``memo`` maps old nodes to new ones, ``nhwc`` holds the
    new nodes whose value is channels-last."""

    def __init__(self) -> None:
        self.memo: dict[int, Node] = {}
        self.nhwc: set[int] = set()
        self._changes: dict[tuple[int, str], Node] = {}
        self.fired = 0

    def visit(self, n: Node) -> None:
        src = [self.memo[id(s)] for s in n.src]
        new, is_nhwc = None, False
        if _relayable(n):
            new, is_nhwc = self._spatial(n, src), True
        elif n.op in FOLLOWERS and any(id(s) in self.nhwc for s in src):
            new, is_nhwc = _follow(n, src, self.to_nhwc)
        if new is None:
            new = self._plain(n, src)
        self.fired += int(is_nhwc)
        self.memo[id(n)] = new
        if is_nhwc:
            self.nhwc.add(id(new))

    # -- layout changes, cached per tensor and direction --------------------------------------

    def to_nhwc(self, x: Node) -> Node:
        return x if id(x) in self.nhwc else self._change(x, "nhwc", TO_NHWC)

    def nchw(self, x: Node) -> Node:
        return self._change(x, "nchw", TO_NCHW) if id(x) in self.nhwc else x

    def _change(self, x: Node, layout: str, dims: tuple[int, ...]) -> Node:
        key = (id(x), layout)
        if key not in self._changes:
            self._changes[key] = layout_change(x, layout, dims)
        return self._changes[key]

    # -- the three kinds of node ---------------------------------------------------------------

    def _spatial(self, n: Node, src: list[Node]) -> Node:
        new_src = [self.to_nhwc(src[0]), *src[1:]]
        if n.op is Op.QCONV2D:
            new_src[1] = self.to_nhwc(src[1])   # OIHW -> OHWI: a transposed constant
        return n.with_(shape=permuted(n.shape, TO_NHWC), src=tuple(new_src),
                       attrs=n.attrs.replace(layout="nhwc"))

    def _plain(self, n: Node, src: list[Node]) -> Node:
        if len(src) == 1 and id(src[0]) in self.nhwc and (folded := _absorb(n, src[0])):
            return folded
        new_src = tuple(self.nchw(s) for s in src)
        if all(a is b for a, b in zip(new_src, n.src, strict=True)):
            return n
        return n.with_(src=new_src)


def layout_change(x: Node, layout: str, dims: tuple[int, ...]) -> Node:
    """``x`` permuted by ``dims``: a transposed constant, a RESHAPE when only size-1 dims move,
    else a PERMUTE; tagged with the ``layout`` of the result."""
    shape = permuted(x.shape, dims)
    if x.op is Op.CONST:
        value = np.ascontiguousarray(np.transpose(x.attrs.value, dims))
        return x.with_(shape=shape, attrs=x.attrs.replace(value=value))
    if _moves_only_ones(x.shape, dims):
        return Node(Op.RESHAPE, x.dtype, shape, (x,), Attrs(shape=shape, layout=layout), x.loc)
    return Node(Op.PERMUTE, x.dtype, shape, (x,), Attrs(dims=dims, layout=layout), x.loc)


def _moves_only_ones(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    kept = [d for d in dims if shape[d] != 1]
    return kept == sorted(kept)


def _absorb(n: Node, x: Node) -> Node | None:
    """``n`` reading NHWC ``x`` directly where the layout change back folds into ``n``: a reshape
    (when the change is itself a reshape), a permute (composed), a sum over H and W."""
    if n.op is Op.RESHAPE and _moves_only_ones(x.shape, TO_NCHW):
        return n.with_(src=(x,))
    if n.op is Op.PERMUTE:   # the identity (a model's own move to NHWC) goes in dead-code
        return n.with_(src=(x,), attrs=n.attrs.replace(dims=tuple(TO_NCHW[d]
                                                                  for d in n.attrs.dims)))
    if n.op is Op.QSUM and not n.attrs.keepdim:
        dims = tuple(sorted(POS[d] for d in n.attrs.dims))
        kept = [POS[d] for d in range(4) if d not in n.attrs.dims]
        if kept == sorted(kept):   # the remaining axes keep their order: same result
            return n.with_(src=(x,), attrs=n.attrs.replace(dims=dims))
    return None


def _follow(n: Node, src: list[Node],
            to_nhwc: Callable[[Node], Node]) -> tuple[Node | None, bool]:
    """``n`` rebuilt channels-last on NHWC operands (None when it cannot follow)."""
    if any(len(s.shape) != 4 for s in src) or len(n.shape) != 4:
        return None, False
    if n.op is Op.DEQUANT and src[0].dtype.is_int8:
        return None, False   # int8 -> f32 leaves the region: change layout on the int8 side
    if n.op is Op.QSUM and not n.attrs.keepdim:
        return None, False
    attrs = n.attrs
    if n.op is Op.REQUANT and attrs.rq.axis is not None:
        attrs = attrs.replace(rq=replace(attrs.rq, axis=POS[attrs.rq.axis]))
    elif n.op is Op.DEQUANT and attrs.qp.axis is not None:
        attrs = attrs.replace(qp=replace(attrs.qp, axis=POS[attrs.qp.axis]))
    elif n.op is Op.CAT:
        attrs = attrs.replace(axis=POS[attrs.axis])
    elif n.op is Op.PAD:
        attrs = attrs.replace(pads=pads_nhwc(attrs.pads))
    elif n.op is Op.QSUM:
        attrs = attrs.replace(dims=tuple(sorted(POS[d] for d in attrs.dims)))
    new_src = tuple(to_nhwc(s) for s in src)
    return n.with_(shape=permuted(n.shape, TO_NHWC), src=new_src, attrs=attrs), True


def pads_nhwc(pads: tuple[int, ...]) -> tuple[int, ...]:
    """Torch-order pads (last dim first) of an NCHW tensor, for its NHWC form."""
    width = [(0, 0)] * 4
    for i in range(len(pads) // 2):
        width[3 - i] = (pads[2 * i], pads[2 * i + 1])
    moved = permuted(tuple(width), TO_NHWC)
    flat = [p for axis in reversed(range(4)) for p in moved[axis]]
    while len(flat) > 2 and flat[-2:] == [0, 0]:
        del flat[-2:]
    return tuple(flat)


def is_layout_change(n: Node) -> bool:
    """A PERMUTE/RESHAPE this pass inserted (it only re-lays its operand's value)."""
    return n.op in (Op.PERMUTE, Op.RESHAPE) and "layout" in n.attrs


def nhwc_values(g: Graph) -> set[int]:
    """``id`` of every node whose value is channels-last (the transpose of its NCHW value)."""
    found: set[int] = set()
    for n in g.nodes():
        if len(n.shape) != 4:
            continue
        if n.op in SPATIAL or n.op in (Op.PERMUTE, Op.RESHAPE):
            nhwc = n.attrs.get("layout") == "nhwc"
        elif n.op is Op.QSUM:
            nhwc = n.attrs.keepdim and id(n.src[0]) in found
        else:
            nhwc = n.op in FOLLOWERS and any(id(s) in found for s in n.src)
        if nhwc:
            found.add(id(n))
    return found

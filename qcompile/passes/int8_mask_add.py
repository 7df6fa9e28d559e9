r"""int8-mask-add

    dequant(x_q)     g(m)  (m: integer tensor, g: monotone float ops)         x_q   m
            \        /                                                  ==>     \   /
               add                                                           MASK_LUT(T[4][256])
                |                                                                -> int8
           quant(qp_out)

An additive attention mask is a float bias computed from the integer mask input alone
(``(1 - mask) * -10000``): at its values 0 and 1 the quantized sum is one of two 256-entry tables
of the scores' code, ``T_m[x] = Q(DQ(x) + g(m))``, computed with the graph's own float ops
(reshapes and permutes on the way move the integer mask instead). ``g`` is monotone and
saturates Q at -1 and 2 already (``T_-1`` all ``qmin``, ``T_2`` all ``qmax``, or the reverse), so
every other integer mask value gives the ``T_-1`` or ``T_2`` codes: the table index
``clamp(m, -1, 2) + 1`` makes the result exact for any mask, not only 0/1. A table lookup
feeding it alone (the scale ``1/sqrt(d)``) folds into the tables. The scores then stay int8 from
Q·Kᵀ to P·V.
"""

from __future__ import annotations

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import Graph, Node, Op, node
from qcompile.ir.types import QParams
from qcompile.passes.base import Context, RewritePass, dequant_of, quantized_producer

MONOTONE_ATEN = frozenset({"aten.to.dtype", "aten._to_copy.default", "aten.rsub.Scalar",
                           "aten.neg.default"})
ARITH = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV})
MASK_VALUES = (-1, 0, 1, 2)


class Int8MaskAdd(RewritePass):
    name = "int8-mask-add"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        add = quantized_producer(n, ctx, frozenset({Op.ADD}))
        if add is None or len(add.src) != 2:
            return None
        for x, bias in (add.src, add.src[::-1]):
            x_qp, found = dequant_of(x), _integer_root(bias)
            if x_qp is None or not x_qp.per_tensor or found is None:
                continue
            tables = _tables(x_qp, n.attrs.qp, bias, found[0])
            if tables is not None:
                codes, tables = _through_lut(x.src[0], tables, ctx) if ctx.single_user(x) \
                    else (x.src[0], tables)
                return node(Op.MASK_LUT, n.dtype, n.shape, codes, found[1], table=tables,
                            loc=add.loc)
        return None


def _through_lut(codes: Node, tables: np.ndarray, ctx: Context) -> tuple[Node, np.ndarray]:
    """A table lookup read only here (attention's ``scores * 1/sqrt(d)``) folds into the mask
    tables, ``T'[m][c] = T[m][lut[c]]``: one lookup per score instead of two."""
    if codes.op is not Op.LUT or not ctx.single_user(codes):
        return codes, tables
    lo = codes.dtype.range[0]
    return codes.src[0], tables[:, np.asarray(codes.attrs.table, np.int64) - lo]


def _integer_root(bias: Node) -> tuple[Node, Node] | None:
    """``(root, mask)`` when ``bias`` is a monotone elementwise float function of the integer
    tensor ``root`` behind reshapes/permutes; ``mask`` is ``root`` moved the same way (int)."""
    cur, moves = bias, []
    while cur.dtype.is_float:
        if cur.op is Op.FLOAT_OP and cur.attrs.target in MONOTONE_ATEN and len(cur.src) == 1:
            cur = cur.src[0]
        elif cur.op in (Op.RESHAPE, Op.PERMUTE):   # commute with elementwise ops
            moves.append(cur)
            cur = cur.src[0]
        elif cur.op in ARITH and len(cur.src) == 2 and any(_scalar(s) for s in cur.src):
            tensor = [s for s in cur.src if not _scalar(s)]
            if len(tensor) != 1 or tensor[0].shape != cur.shape:
                return None
            cur = tensor[0]
        else:
            return None
    if cur is bias:
        return None
    mask = cur
    for mv in reversed(moves):
        mask = mv.with_(dtype=cur.dtype, src=(mask,))
    return cur, mask


def _scalar(n: Node) -> bool:
    return n.op is Op.CONST and n.dtype.is_float and np.size(n.attrs.value) == 1


def _tables(x: QParams, out: QParams, bias: Node, root: Node) -> np.ndarray | None:
    """``T[m + 1][code]`` for m in -1..2, or ``None`` unless the bias is uniform per mask value
    and saturates the output at -1 and 2 (so the clamp of m is exact)."""
    values = _bias_values(bias, root)
    if values is None or values[1] == values[2]:
        return None
    lo, hi = x.dtype.range
    real = qmath.dequantize_array(np.arange(lo, hi + 1), x)
    tables = np.stack([qmath.quantize_array(real + np.float32(v), out) for v in values])
    low, high = (out.qmin, out.qmax) if values[2] > values[1] else (out.qmax, out.qmin)
    if not (np.all(tables[0] == low) and np.all(tables[3] == high)):
        return None
    return tables.astype(np.int64)


def _bias_values(bias: Node, root: Node) -> list[np.float32] | None:
    """The bias at every element for a mask filled with each of MASK_VALUES (the graph's own
    float ops, run by the reference interpreter); ``None`` if it is not uniform."""
    from qcompile.reference import interpreter

    inp = node(Op.INPUT, root.dtype, root.shape, name="mask")
    memo = {id(root): inp}

    def rebuild(n: Node) -> Node:
        if id(n) not in memo:
            memo[id(n)] = n.with_(src=tuple(rebuild(s) for s in n.src))
        return memo[id(n)]

    graph = Graph("mask-bias", (inp,), (rebuild(bias),))
    found = []
    for v in MASK_VALUES:
        (b,) = interpreter.run(graph, np.full(root.shape, v, dtype=root.dtype.np))
        flat = np.asarray(b, np.float32).reshape(-1)
        if flat.size == 0 or not np.all(flat == flat[0]):
            return None
        found.append(flat[0])
    return found

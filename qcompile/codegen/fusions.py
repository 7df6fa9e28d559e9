"""Chains that the backends fuse the same way (the cpu microkernel, the cuda Triton kernels).

**Attention**, one kernel per layer (cpu ``qk_attention_u8``, cuda ``attention``)::

    q·kᵀ (QMATMUL) → REQUANT → [MASK_LUT] → QSOFTMAX (last axis, u8) → ·v (QMATMUL) → REQUANT
    → PERMUTE (0, 2, 1, 3) → RESHAPE [N, S, H·D]

with q, k and v head splits (``reshape`` + ``permute``) of ``[N, S, H·D]`` int8 tensors. The
kernel reads those three tensors and writes the merged result; the nodes between are not
computed on their own.

**A table after a requantize** (:func:`table_reader`: GELU after FFN in): the kernel that ends
in the requantize stores the table's entries instead of the codes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType


@dataclass(frozen=True)
class Attention:
    """One attention chain the fused kernel computes (:func:`attention_chains`): the sources
    ``[N, S, H·D]`` of q, k and v, the chain's nodes, and the head merge (permute, reshape) that
    reads its result."""

    q: Node
    k: Node
    v: Node
    qk: Node
    rq1: Node
    mask: Node | None            # the MASK_LUT (its src[1] is the mask)
    softmax: Node
    pv: Node
    rq2: Node
    merge: tuple[Node, Node]

    @property
    def inner(self) -> tuple[Node, ...]:
        """The nodes that are not emitted (the kernel computes them)."""
        return tuple(n for n in (self.qk, self.rq1, self.mask, self.softmax, self.pv, self.rq2)
                     if n is not None)


def _split_heads(x: Node, dims: tuple[int, ...]) -> Node | None:
    """``src`` when ``x = permute(reshape(src, [N, S, H, D]), dims)`` with ``src`` ``[N, S,
    H·D]`` int8, else None."""
    if x.op is not Op.PERMUTE or tuple(x.attrs.dims) != dims:
        return None
    r = x.src[0]
    if r.op is not Op.RESHAPE or len(r.shape) != 4 or not r.dtype.is_int8:
        return None
    src = r.src[0]
    nb, s, h, d = r.shape
    return src if src.shape == (nb, s, h * d) else None


def _keys(x: Node) -> Node | None:
    """The source of Kᵀ ``[N, H, D, S]``: one permute (0, 2, 3, 1) of the split heads, or
    (0, 2, 1, 3) then (0, 1, 3, 2)."""
    if x.op is not Op.PERMUTE:
        return None
    if tuple(x.attrs.dims) == (0, 1, 3, 2):
        return _split_heads(x.src[0], (0, 2, 1, 3))
    return _split_heads(x, (0, 2, 3, 1))


def table_reader(n: Node, users: dict[int, list[Node]], outputs: set[int]) -> Node | None:
    """The 256-entry table lookup (``LUT``: GELU, hardswish, ... as tables) that is the only
    reader of the requantize ``n`` (not a graph output: ``outputs`` holds their ids), else
    None."""
    readers = users.get(id(n), [])
    if n.op is not Op.REQUANT or id(n) in outputs or len(readers) != 1:
        return None
    t = readers[0]
    if t.op is not Op.LUT or t.src[0] is not n or not t.dtype.is_int8 or \
            np.asarray(t.attrs.table).size != 256:
        return None
    return t


def scalar_requant(n: Node) -> tuple[int, int, int, int, int, int]:
    """A per-tensor one-term requantize (:func:`_single_rq`) as ``(bias, multiplier, shift,
    zero point out, qmin, qmax)``, its bias minus the term's zero point."""
    rq = n.attrs.rq
    return (-int(rq.terms[0].zero_point), int(np.asarray(rq.terms[0].multiplier).reshape(-1)[0]),
            int(np.asarray(rq.shift).reshape(-1)[0]), int(rq.zp_out), int(rq.qmin),
            int(rq.qmax))


def _single_rq(n: Node) -> bool:
    """A per-tensor requantize of one term onto int8."""
    if n.op is not Op.REQUANT:
        return False
    rq = n.attrs.rq
    return len(n.src) == 1 and len(rq.terms) == 1 and \
        np.asarray(rq.terms[0].multiplier).size == 1 and np.asarray(rq.shift).size == 1 and \
        rq.out_dtype.is_int8 and 1 <= int(np.asarray(rq.shift).reshape(-1)[0]) <= 62


def attention_chains(graph: Graph, users: dict[int, list[Node]],
                     fits: Callable[[int, int], str | None]
                     ) -> tuple[dict[int, Attention], dict[str, int]]:
    """``id(node) -> Attention`` for every node of each chain ``q·kᵀ → requant → [mask_lut] →
    softmax (last axis) → ·v → requant → head merge`` (each intermediate read only by the next,
    none a graph output) whose ``S`` keys and head size ``D`` the backend's kernel takes
    (``fits(S, D)``: ``None``, else why not), and the count of each reason a softmax's chain
    is not fused."""
    outputs = {id(o) for o in graph.outputs}
    chains: dict[int, Attention] = {}
    why: dict[str, int] = {}

    def only(n: Node) -> Node | None:
        readers = users.get(id(n), [])
        return readers[0] if len(readers) == 1 and id(n) not in outputs else None

    for sm in graph.nodes():
        if sm.op is not Op.QSOFTMAX:
            continue
        reason, att = _attention(sm, only, fits)
        if att is None:
            why[reason] = why.get(reason, 0) + 1
            continue
        for n in (*att.inner, *att.merge):
            chains[id(n)] = att
    return chains, why


def _attention(sm: Node, only: Callable[[Node], Node | None],
               fits: Callable[[int, int], str | None]) -> tuple[str, Attention | None]:
    if sm.attrs.axis != len(sm.shape) - 1 or len(sm.shape) != 4:
        return "softmax is not over the last of 4 axes", None
    if sm.dtype is not DType.U8:
        return "probabilities are not u8", None
    ml = sm.src[0] if sm.src[0].op is Op.MASK_LUT else None
    rq1 = ml.src[0] if ml is not None else sm.src[0]
    if ml is not None:
        mask = ml.src[1]
        if only(ml) is not sm or mask.dtype is not DType.I64 or len(mask.shape) != 4 or \
                mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, sm.shape[0]) or \
                mask.shape[3] != sm.shape[3] or np.asarray(ml.attrs.table).shape != (4, 256):
            return "mask is not an i64 [N, 1, 1, S] key mask", None
    if not _single_rq(rq1) or only(rq1) is not (ml or sm):
        return "scores are not one per-tensor requantize", None
    qk = rq1.src[0]
    if qk.op is not Op.QMATMUL or only(qk) is not rq1:
        return "scores are not a matmul", None
    pv = only(sm)
    rq2 = only(pv) if pv is not None else None
    if pv is None or pv.op is not Op.QMATMUL or pv.src[0] is not sm or rq2 is None or \
            not _single_rq(rq2):
        return "probabilities do not feed one matmul and requantize", None
    perm = only(rq2)
    merge = only(perm) if perm is not None else None
    if perm is None or perm.op is not Op.PERMUTE or tuple(perm.attrs.dims) != (0, 2, 1, 3) or \
            merge is None or merge.op is not Op.RESHAPE or len(merge.shape) != 3:
        return "the heads are not merged by a permute and reshape", None
    q, k, v = _split_heads(qk.src[0], (0, 2, 1, 3)), _keys(qk.src[1]), \
        _split_heads(pv.src[1], (0, 2, 1, 3))
    if q is None or k is None or v is None or not (q.shape == k.shape == v.shape):
        return "q, k, v are not head splits of [N, S, H·D] tensors", None
    nb, h, s, d = qk.src[0].shape
    if merge.shape != (nb, s, h * d) or pv.shape != (nb, h, s, d):
        return "the heads are not merged into [N, S, H·D]", None
    why = fits(s, d)
    if why is not None:
        return why, None
    return "", Attention(q, k, v, qk, rq1, ml, sm, pv, rq2, (perm, merge))

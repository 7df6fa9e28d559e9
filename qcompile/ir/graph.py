"""QIR: qcompile's small immutable graph IR.

A :class:`Node` is frozen: its op, result dtype and static shape, its source nodes, attributes and a
source location (kept out of comparisons). Nodes compare by identity; structure is compared through
the printer. A :class:`Graph` is its inputs and outputs: whatever the outputs do not reach does not
exist, so dead code disappears with every rebuild.

Shapes are static: a graph is specialised for one batch size (``qcompile.frontend.importer`` builds
one per batch size asked for).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from qcompile.ir.types import DType


class Op(Enum):
    # graph boundary and constants
    INPUT = "input"
    CONST = "const"
    QUANT = "quant"                 # f32 -> i8/u8 (attrs: qp)
    DEQUANT = "dequant"             # i8/u8 (or i32 accumulator) -> f32 (attrs: qp)
    # float ops (as imported from the PT2E graph)
    CONV2D = "conv2d"               # (x, w, bias?) attrs: stride, padding, dilation, groups
    LINEAR = "linear"               # (x, w, bias?)
    MATMUL = "matmul"               # (a, b), batched
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    RELU = "relu"
    CLAMP = "clamp"                 # attrs: lo, hi (relu6, hardtanh, clamp)
    HARDSWISH = "hardswish"
    SILU = "silu"
    GELU = "gelu"                   # attrs: approximate
    SIGMOID = "sigmoid"
    TANH = "tanh"
    MAXPOOL2D = "maxpool2d"         # attrs: kernel, stride, padding, dilation, layout? (int8 too)
    AVGPOOL2D = "avgpool2d"         # attrs: kernel, stride, padding, divisor
    MEAN = "mean"                   # attrs: dims, keepdim
    RESHAPE = "reshape"             # attrs: shape, layout? (also on int8)
    PERMUTE = "permute"             # attrs: dims, layout? (also on int8; layout: see channels-last)
    CAT = "cat"                     # attrs: axis (also on int8)
    PAD = "pad"                     # attrs: pads (torch order), value (also on int8)
    SOFTMAX = "softmax"             # attrs: axis
    LAYER_NORM = "layer_norm"       # (x, w?, b?) attrs: normalized_shape, eps
    EMBEDDING = "embedding"         # (table, ids)
    FLOAT_OP = "float_op"           # any other aten op, run as is (attrs: target, template)
    # integer ops (produced by the pass pipeline)
    QCONV2D = "qconv2d"             # (x_q, w_i8, bias_i32) -> i32; attrs as conv2d + x_zp, layout
    QLINEAR = "qlinear"             # (x_q, w_i8, bias_i32) -> i32; attrs: x_zp
    QMATMUL = "qmatmul"             # (a_q, b_q) -> i32; attrs: a_zp, b_zp
    QMUL = "qmul"                   # (a_q, b_q) -> i32 = (a - a_zp) * (b - b_zp)
    QSUMPOOL2D = "qsumpool2d"       # x_q -> i32 window sums of (x - x_zp); attrs as pool, layout
    QSUM = "qsum"                   # x_q -> i32 sums of (x - x_zp) over dims
    REQUANT = "requant"             # (terms...) -> i8/u8; attrs: rq (ir.types.Requant)
    LUT = "lut"                     # x_q -> i8/u8; attrs: table (256 entries)
    QSOFTMAX = "qsoftmax"           # x_q -> i8/u8 softmax on codes (qmath); attrs: axis, table
                                    # (i64 exp table), m (output multiplier), zp, range
    QLAYERNORM = "qlayernorm"       # x_q -> i8/u8 layer norm over the last axis on codes (qmath);
                                    # attrs: x_zp, e, g, b, sh (i64 per channel), zp, range; or
                                    # x f32 (codes per row): code_bits, k_max, e, e_shift, g, b, sh
    MASK_LUT = "mask_lut"           # (x_q, m integer, broadcast) -> i8/u8 = table[clamp(m,-1,2)+1]
                                    # [x - lo]; attrs: table (i64 [4, 256])


INTEGER_OPS = frozenset({Op.QCONV2D, Op.QLINEAR, Op.QMATMUL, Op.QMUL, Op.QSUMPOOL2D, Op.QSUM,
                         Op.REQUANT, Op.LUT, Op.QSOFTMAX, Op.QLAYERNORM,
                         Op.MASK_LUT})
ANCHOR_OPS = frozenset({Op.QCONV2D, Op.QLINEAR, Op.QMATMUL, Op.QMUL, Op.QSUMPOOL2D, Op.QSUM})
DATA_MOVEMENT = frozenset({Op.RESHAPE, Op.PERMUTE, Op.CAT, Op.PAD, Op.MAXPOOL2D})
UNARY_FLOAT = frozenset({Op.RELU, Op.CLAMP, Op.HARDSWISH, Op.SILU, Op.GELU, Op.SIGMOID, Op.TANH})


class Attrs(Mapping[str, Any]):
    """An immutable attribute mapping with attribute access (``node.attrs.stride``)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        object.__setattr__(self, "_items", dict(sorted({**(items or {}), **kw}.items())))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __getattr__(self, key: str) -> Any:
        try:
            return self._items[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Attrs are immutable")

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def replace(self, **kw: Any) -> Attrs:
        return Attrs({**self._items, **kw})

    def without(self, *keys: str) -> Attrs:
        return Attrs({k: v for k, v in self._items.items() if k not in keys})

    def __repr__(self) -> str:
        return f"Attrs({self._items!r})"


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    op: Op
    dtype: DType
    shape: tuple[int, ...]
    src: tuple[Node, ...] = ()
    attrs: Attrs = field(default_factory=Attrs)
    loc: str | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_(self, **changes: Any) -> Node:
        """A copy with some fields replaced (nodes are immutable)."""
        fields = {"op": self.op, "dtype": self.dtype, "shape": self.shape, "src": self.src,
                  "attrs": self.attrs, "loc": self.loc}
        return Node(**{**fields, **changes})


def node(op: Op, dtype: DType, shape: tuple[int, ...], /, *src: Node, loc: str | None = None,
         **attrs: Any) -> Node:
    """Shorthand constructor: ``node(Op.RELU, F32, (1, 8), x, loc=...)``."""
    return Node(op, dtype, tuple(shape), tuple(src), Attrs(attrs), loc)


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]

    def nodes(self) -> list[Node]:
        """Every node reachable from the outputs (plus the inputs), in topological order."""
        order: list[Node] = []
        seen: set[int] = set()
        for root in (*self.inputs, *self.outputs):
            stack: list[tuple[Node, bool]] = [(root, False)]
            while stack:
                n, expanded = stack.pop()
                if expanded:
                    order.append(n)
                    continue
                if id(n) in seen:
                    continue
                seen.add(id(n))
                stack.append((n, True))
                stack.extend((s, False) for s in reversed(n.src) if id(s) not in seen)
        return order

    def users(self) -> dict[int, list[Node]]:
        """``id(node) -> nodes that read it`` (a node reading twice is listed twice)."""
        result: dict[int, list[Node]] = {}
        for n in self.nodes():
            for s in n.src:
                result.setdefault(id(s), []).append(n)
        return result

    def with_outputs(self, outputs: tuple[Node, ...]) -> Graph:
        return Graph(self.name, self.inputs, outputs)

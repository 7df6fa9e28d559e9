r"""check-integer-only — the gate at the end of the pipeline.

Every float compute node left between the first quantize and the last dequantize becomes an
explicit, reported float fallback: it keeps its op and gains ``fallback=<reason>``. With the
``error`` policy the first such node raises instead. Float work outside that region (an embedding
lookup before the first quantize, pooling after the last dequantize) is reported too, as
``outside``.
"""

from __future__ import annotations

from qcompile.errors import UnsupportedGraphError
from qcompile.ir.graph import INTEGER_OPS, Graph, Node, Op
from qcompile.passes.base import Context, RewritePass

BOUNDARY = frozenset({Op.INPUT, Op.CONST, Op.QUANT, Op.DEQUANT})
_REASONS = {
    Op.SOFTMAX: "softmax runs in float: int8-softmax needs a per-tensor int8 input and output",
    Op.LAYER_NORM: "layer_norm runs in float: int8-layer-norm needs a per-tensor int8 input and "
                   "output, constant affine parameters and rows of at most 2896",
    Op.EMBEDDING: "embedding lookup reads a float table",
    Op.FLOAT_OP: "no QIR op for this aten op: run as is",
}


def float_reason(n: Node) -> str:
    if n.op in (Op.PERMUTE, Op.RESHAPE) and "layout" in n.attrs:
        return f"channels-last: the float result of an NHWC chain back in {n.attrs.layout}"
    if n.op in _REASONS:
        return _REASONS[n.op] + (f" ({n.attrs.target})" if n.op is Op.FLOAT_OP else "")
    if n.op in (Op.CONV2D, Op.LINEAR) and any(s.op is Op.CONST and s.dtype.is_float
                                              for s in n.src[1:2]):
        return f"{n.op.value} weights are not quantized (module skipped or not annotated)"
    if not any(s.op is Op.DEQUANT for s in n.src):
        return f"{n.op.value} reads float values that no quantize covers (quantizer left it float)"
    return f"{n.op.value} output is not quantized: no rule rewrites it into an int8 chain"


def int8_region(g: Graph) -> set[int]:
    """Nodes downstream of an activation quantize and upstream of a dequantize (or quantize)."""
    nodes = g.nodes()
    after: set[int] = set()
    for n in nodes:
        if (n.op is Op.QUANT and n.src[0].op is not Op.CONST) or any(id(s) in after
                                                                       for s in n.src):
            after.add(id(n))
    before: set[int] = set()
    for n in reversed(nodes):
        if n.op is Op.DEQUANT or id(n) in before or _float_result(n):
            before.add(id(n))
            before.update(id(s) for s in n.src)
    return after & before


def _float_result(n: Node) -> bool:
    """An integer op that ends in a float result (a layer norm read by float code): like a
    dequantize, the int8 region ends at it, and it is no float op."""
    return n.op in INTEGER_OPS and n.dtype.is_float


def float_compute(n: Node) -> bool:
    """``n`` computes in float: no boundary (input, constant, quantize, dequantize) and no
    integer op with a float result."""
    return n.dtype.is_float and n.op not in BOUNDARY and not _float_result(n)


class CheckIntegerOnly(RewritePass):
    name = "check-integer-only"

    def __init__(self, policy: str = "fallback") -> None:
        if policy not in ("fallback", "error"):
            raise ValueError(f"policy must be 'fallback' or 'error', not {policy!r}")
        self.policy = policy
        self._region: set[int] = set()

    def run(self, g: Graph) -> tuple[Graph, int]:
        self._region = int8_region(g)
        return super().run(g)

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if not float_compute(n) or "fallback" in n.attrs:
            return None
        inside = id(n) in self._region
        reason = float_reason(n)
        if inside and self.policy == "error":
            raise UnsupportedGraphError(
                f"check-integer-only: float op '{n.op.value}' survived integer lowering",
                at=f"{n.loc} (f32{list(n.shape)})", why=reason,
                next="set compile float_ops policy to 'fallback' to keep it in float, or "
                     "quantize it (quantizer kind 'qcompile' annotates more ops)")
        return n.with_(attrs=n.attrs.replace(fallback=reason,
                                             region="inside" if inside else "outside"))

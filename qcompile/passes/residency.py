"""Int8 residency analysis: what stays int8 between the first quantize and the last dequantize.

For every edge (producer → consumer) inside that region: its bytes, by the producer's dtype.
``int8_bytes_fraction`` = int8 bytes / (int8 + float bytes). i32 accumulators only ever feed the
requantize of their own chain (the verifier's rules ensure it); they are reported apart as
``i32_fused_bytes`` because code generation keeps them in registers. Constants are not edges.
"""

from __future__ import annotations

from typing import Any

from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op
from qcompile.passes.check_integer_only import float_compute, float_reason, int8_region


def _chain(n: Node) -> dict[str, Any] | None:
    """A fused chain ends in a requantize (or a dequantize) of an integer anchor."""
    if n.op not in (Op.REQUANT, Op.DEQUANT) or not n.src or n.src[0].op not in ANCHOR_OPS:
        return None
    anchor = n.src[0]
    fused = [anchor.op.value, "requant" if n.op is Op.REQUANT else "dequant"]
    if n.op is Op.REQUANT and len(n.src) > 1:
        fused.append("residual-add")
    if n.op is Op.REQUANT and (n.attrs.rq.qmin, n.attrs.rq.qmax) != n.dtype.range:
        fused.append("clamp")
    return {"loc": anchor.loc, "ops": fused, "out": n.dtype.value}


def residency(g: Graph) -> dict[str, Any]:
    region = int8_region(g)
    int8 = flt = i32 = 0
    for n in g.nodes():
        for s in n.src:
            if s.op is Op.CONST or id(s) not in region or id(n) not in region:
                continue
            if s.dtype.is_int8:
                int8 += s.nbytes
            elif s.dtype.is_float:
                flt += s.nbytes
            else:
                i32 += s.nbytes
    chains = [c for c in (_chain(n) for n in g.nodes()) if c]
    floats = [{"op": n.op.value, "loc": n.loc, "shape": list(n.shape),
               "region": "inside" if id(n) in region else "outside",
               "reason": n.attrs.get("fallback") or float_reason(n)}
              for n in g.nodes() if float_compute(n)]
    return {"int8_bytes_fraction": int8 / (int8 + flt) if int8 + flt else 1.0,
            "int8_bytes": int8, "float_bytes": flt, "i32_fused_bytes": i32,
            "chains": chains, "chain_count": len(chains),
            "float_ops": floats, "float_ops_inside": sum(f["region"] == "inside" for f in floats),
            "segments": _segments(g, region)}


def _segments(g: Graph, region: set[int]) -> list[int]:
    """Sizes (compute nodes) of the connected int8 segments, largest first."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    members = [n for n in g.nodes() if not n.dtype.is_float and n.op not in (Op.CONST, Op.INPUT)
               and id(n) in region]
    ids = {id(n) for n in members}
    for n in members:
        find(id(n))
        for s in n.src:
            if id(s) in ids:
                parent[find(id(s))] = find(id(n))
    sizes: dict[int, int] = {}
    for n in members:
        sizes[find(id(n))] = sizes.get(find(id(n)), 0) + 1
    return sorted(sizes.values(), reverse=True)

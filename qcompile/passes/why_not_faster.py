"""Why-not-faster analysis of post-pipeline QIR: what keeps an int8 model from int8 speed.

* ``int8_mac_fraction``: multiply-accumulates in integer contractions over all contractions
  (float convolutions, linears and matmuls left over are where the int8 peak is lost);
* ``float_islands``: connected groups of float compute ops inside the int8 region, each with its
  ops, bytes and the integer-only gate's reasons;
* ``conversions``: quantize/dequantize nodes left, split into the model's edges (input quantize,
  output dequantize) and the ones inside (each one a float round trip through memory);
* ``chains``: fused chain count, ops per chain, and the int8 segments (connected integer
  stretches; one long segment is the fast case);
* ``bytes_moved``: bytes each op reads and writes if every activation goes through memory once,
  by dtype (i32 accumulators stay in registers inside fused chains and are not counted), against
  the same graph in float32;
* ``findings``: the above as sentences, the largest cost first.
"""

from __future__ import annotations

import math
from typing import Any

from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op
from qcompile.passes.check_integer_only import float_compute, float_reason, int8_region
from qcompile.passes.residency import _chain, residency

CONTRACTIONS = {Op.QCONV2D: True, Op.QLINEAR: True, Op.QMATMUL: True,
                Op.CONV2D: False, Op.LINEAR: False, Op.MATMUL: False}


def macs(n: Node) -> int:
    """Multiply-accumulates of a contraction (0 for anything else)."""
    if n.op in (Op.QCONV2D, Op.CONV2D):
        w = n.src[1].shape          # F x C/g x KH x KW, or F x KH x KW x C/g (nhwc)
        return n.numel * math.prod(w[1:])
    if n.op in (Op.QLINEAR, Op.LINEAR):
        return n.numel * n.src[1].shape[-1]
    if n.op in (Op.QMATMUL, Op.MATMUL):
        return n.numel * n.src[0].shape[-1]
    return 0


def _islands(g: Graph, region: set[int]) -> list[dict[str, Any]]:
    members = [n for n in g.nodes() if id(n) in region and float_compute(n)]
    ids = {id(n) for n in members}
    parent = {i: i for i in ids}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in members:
        for s in n.src:
            if id(s) in ids:
                parent[find(id(s))] = find(id(n))
    groups: dict[int, list[Node]] = {}
    for n in members:
        groups.setdefault(find(id(n)), []).append(n)
    out = [{"ops": [n.op.value for n in ns], "first": ns[0].loc,
            "bytes": sum(n.nbytes for n in ns),
            "reasons": sorted({n.attrs.get("fallback") or float_reason(n) for n in ns})}
           for ns in groups.values()]
    return sorted(out, key=lambda i: -i["bytes"])


def _conversions(g: Graph) -> dict[str, Any]:
    outputs = {id(o) for o in g.outputs}
    edge = inside = 0
    where: list[str] = []
    for n in g.nodes():
        if n.op is Op.QUANT and n.src[0].op is not Op.CONST:
            at_edge = n.src[0].op is Op.INPUT
        elif n.op is Op.DEQUANT:
            at_edge = id(n) in outputs
        else:
            continue
        edge, inside = edge + at_edge, inside + (not at_edge)
        if not at_edge:
            where.append(f"{n.op.value} {n.loc}")
    return {"at_edges": edge, "inside": inside, "inside_at": where}


def _bytes_moved(g: Graph) -> dict[str, Any]:
    by_dtype: dict[str, int] = {}
    as_f32 = 0
    for n in g.nodes():
        if n.op in (Op.INPUT, Op.CONST):
            continue
        for v in (*n.src, n):   # an accumulator only feeds its own epilogue: registers
            if v.op is Op.CONST or v.op in ANCHOR_OPS:
                continue
            by_dtype[v.dtype.value] = by_dtype.get(v.dtype.value, 0) + v.nbytes
            as_f32 += v.numel * 4
    weights = sum(n.nbytes for n in g.nodes() if n.op is Op.CONST)
    total = sum(by_dtype.values())
    return {"activations": by_dtype, "activations_total": total, "weights": weights,
            "activations_if_f32": as_f32,
            "fraction_of_f32": round(total / as_f32, 4) if as_f32 else None}


def why_not_faster(g: Graph) -> dict[str, Any]:
    region = int8_region(g)
    contractions = [(CONTRACTIONS[n.op], macs(n), n) for n in g.nodes() if n.op in CONTRACTIONS]
    int_macs = sum(m for is_int, m, _ in contractions if is_int)
    all_macs = sum(m for _, m, _ in contractions)
    res = residency(g)
    chains = [c for c in (_chain(n) for n in g.nodes()) if c]
    report = {
        "int8_mac_fraction": int_macs / all_macs if all_macs else None,
        "macs": {"int8": int_macs, "float": all_macs - int_macs},
        "float_contractions": [{"op": n.op.value, "loc": n.loc, "macs": m}
                               for is_int, m, n in contractions if not is_int],
        "int8_bytes_fraction": res["int8_bytes_fraction"],
        "float_islands": _islands(g, region),
        "conversions": _conversions(g),
        "chains": {"count": len(chains), "ops_per_chain": _histogram([len(c["ops"])
                                                                      for c in chains]),
                   "segments": res["segments"]},
        "bytes_moved": _bytes_moved(g),
    }
    report["findings"] = findings(report)
    return report


def _histogram(values: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in sorted(values):
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def findings(r: dict[str, Any]) -> list[str]:
    """The report as sentences, the costliest first (or that nothing stands in the way)."""
    out: list[str] = []
    frac = r["int8_mac_fraction"]
    if frac is not None and frac < 1.0:
        worst = max(r["float_contractions"], key=lambda c: c["macs"])
        out.append(f"{100 * (1 - frac):.1f} % of multiply-accumulates run in float "
                   f"({len(r['float_contractions'])} contraction(s); largest {worst['op']} at "
                   f"{worst['loc']})")
    for island in r["float_islands"][:5]:
        out.append(f"float island of {len(island['ops'])} op(s) ({', '.join(island['ops'][:4])}"
                   f"{', ...' if len(island['ops']) > 4 else ''}) at {island['first']}, "
                   f"{island['bytes']} B: {island['reasons'][0]}")
    conv = r["conversions"]
    if conv["inside"]:
        out.append(f"{conv['inside']} quantize/dequantize conversion(s) inside the model (each a "
                   f"float round trip), first at {conv['inside_at'][0]}")
    segments = r["chains"]["segments"]
    if len(segments) > 1:
        out.append(f"the int8 region is split into {len(segments)} segments {segments[:6]}: "
                   "data crosses to float between them")
    if not out:
        out.append("nothing in the graph stands in the way: every contraction is int8, no float "
                   "island, one int8 segment, conversions only at the model's edges")
    return out


def text(r: dict[str, Any]) -> list[str]:
    b = r["bytes_moved"]
    frac = r["int8_mac_fraction"]
    lines = ["why not faster:",
             f"  int8 MACs: {'—' if frac is None else f'{100 * frac:.2f} %'} "
             f"({r['macs']['int8']:,} int8, {r['macs']['float']:,} float); int8 bytes fraction "
             f"{r['int8_bytes_fraction']:.4f}",
             f"  float islands: {len(r['float_islands'])}; quantize/dequantize left: "
             f"{r['conversions']['at_edges']} at the edges, {r['conversions']['inside']} inside",
             f"  fused chains: {r['chains']['count']} (ops per chain {r['chains']['ops_per_chain']}"
             f"); int8 segments {r['chains']['segments']}",
             f"  bytes moved (activations, each read and written once): {b['activations_total']:,}"
             f" B {b['activations']}, {b['fraction_of_f32']} of the float32 graph's; weights "
             f"{b['weights']:,} B"]
    lines += [f"  - {f}" for f in r["findings"]]
    return lines

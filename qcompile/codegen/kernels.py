"""Which dispatches IREE formed, traced back to QIR chains.

Every op the emitter builds carries the name location ``qir<K>`` of its QIR node (``qir<K>.copy``
for im2col and padding copies). ``iree-compile --compile-to=flow --mlir-print-debuginfo`` keeps
those locations on the ops inside each ``flow.executable``, so for each fused chain (an integer
anchor and the requantize/dequantize that ends it) we can count the dispatches that compute it,
and for each dispatch what it writes to memory. ``max_per_chain`` is over contraction chains
(conv/linear/matmul + epilogue); pool chains are listed in ``per_chain`` too.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op

_ALIAS = re.compile(r"^(#loc\d*) = (loc\(.*\))\s*$", re.M)
_NAME = re.compile(r'"qir(\d+)(\.copy)?"')
_REF = re.compile(r"#loc\d*\b")
_EXEC = re.compile(r"^  flow\.executable private @(\w+) \{$", re.M)
# the VNNI conv microkernel's executables are named by their chain (emit_ukernel.emit)
_UKERNEL = re.compile(r"^  hal\.executable private "
                      r"@(qk_(?:conv|matmul|quant|mlin|attn)_(\d+(?:_\d+)+)) \{$", re.M)
_DISPATCH = re.compile(r"flow\.dispatch @(\w+)::(?:@\w+::)?@(\w+)\(([^)]*)\) : (.*)$", re.M)
# the ops that compute: a linalg.generic (its location follows its region) or a slice copy;
# constants, fills and empties are CSE'd across chains and keep whichever location came first
_COMPUTE = re.compile(r"^\s*\} -> .*$|^.*tensor\.(?:insert|extract)_slice.*$", re.M)
_END = re.compile(r"^  (?:util\.func|func\.func|flow\.executable|hal\.executable)", re.M)
_ELEM = re.compile(r"tensor<(?:[\dx?]+x)?(i8|i32|f32|i64|i1)\b")


def _resolve(text: str, aliases: dict[str, str], seen: set[str]) -> set[tuple[int, bool]]:
    found = {(int(k), bool(c)) for k, c in _NAME.findall(text)}
    for ref in _REF.findall(text):
        if ref in aliases and ref not in seen:
            seen.add(ref)
            found |= _resolve(aliases[ref], aliases, seen)
    return found


def parse_flow(flow: str) -> tuple[dict[str, set[tuple[int, bool]]], list[dict[str, Any]]]:
    """``executable -> {(qir id, is_copy)}`` and the dispatches in call order."""
    aliases = dict(_ALIAS.findall(flow))
    execs: dict[str, set[tuple[int, bool]]] = {}
    for m in _EXEC.finditer(flow):
        nxt = _END.search(flow, m.end())
        body = flow[m.end():nxt.start() if nxt else len(flow)]
        execs[m.group(1)] = _resolve("\n".join(_COMPUTE.findall(body)), aliases, set())
    for m in _UKERNEL.finditer(flow):
        execs[m.group(1)] = {(int(k), False) for k in m.group(2).split("_")}
    calls = [{"executable": m.group(1), "entry": m.group(2),
              "writes": sorted(set(_ELEM.findall(_result_types(m))))}
             for m in _DISPATCH.finditer(flow)]
    return execs, calls


def _signature(text: str) -> tuple[str, str]:
    """``(operand types) -> results loc(...)`` split at its top-level arrow."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "<(") - (ch in ">)" and text[i - 1:i] != "-")
        if depth == 0 and text.startswith(" -> ", i + 1) and ch == ")":
            results = text[i + 5:]
            return text[1:i], results[:results.rfind(" loc(")]
    return text, ""


def _result_types(m: re.Match[str]) -> str:
    """The dispatch's result types; a result tied to an operand (``-> %4``) has its type."""
    operands, results = _signature(m.group(4))
    if not results.lstrip("(").startswith("%"):
        return results
    args = [a.strip() for a in m.group(3).split(",")]
    types = _split_types(operands)
    tied = [t for a, t in zip(args, types, strict=False)
            if a in re.findall(r"%[\w#]+", results)]
    return " ".join(tied)


def _split_types(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for i, ch in enumerate(text):
        depth += (ch in "<(") - (ch in ">)" and text[i - 1:i] != "-")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def chains(graph: Graph) -> list[tuple[Node, Node]]:
    """(anchor, end) pairs: an integer contraction/pool and the requant/dequant ending it."""
    return [(n.src[0], n) for n in graph.nodes()
            if n.op in (Op.REQUANT, Op.DEQUANT) and n.src and n.src[0].op in ANCHOR_OPS]


def analyze(graph: Graph, flow: str) -> dict[str, Any]:
    ids = {id(n): k for k, n in enumerate(graph.nodes())}
    execs, calls = parse_flow(flow)
    computes = {name: {k for k, copy in members if not copy} for name, members in execs.items()}
    rows = []
    for anchor, end in chains(graph):
        mine = {ids[id(anchor)], ids[id(end)]}
        hit = sorted({c["executable"] for c in calls if computes.get(c["executable"],
                                                                    set()) & mine})
        writes = sorted({w for c in calls if c["executable"] in hit for w in c["writes"]})
        rows.append({"loc": anchor.loc, "ops": [anchor.op.value, end.op.value],
                     "dispatches": len(hit), "writes": writes})
    kinds = Counter(_kind(c["entry"]) for c in calls)
    contractions = [r for r in rows if r["ops"][0] in CONTRACTIONS]
    return {
        "total": len(calls),
        "chains": len(rows),
        "max_per_chain": max((r["dispatches"] for r in contractions), default=0),
        "chains_single_dispatch": sum(r["dispatches"] == 1 for r in rows),
        "i32_writes": sum("i32" in c["writes"] for c in calls),
        "copy_dispatches": kinds.get("copy", 0),
        "by_kind": dict(sorted(kinds.items())),
        "per_chain": rows,
    }


CONTRACTIONS = frozenset({Op.QCONV2D.value, Op.QLINEAR.value, Op.QMATMUL.value})


def _kind(entry: str) -> str:
    if entry.startswith("qk_quant_"):         # the microkernel's input quantize
        return "elementwise"
    if entry.startswith("qk_mlin_"):          # linears sharing their input
        return "matmul"
    if "memcpy" in entry or "slow_memcpy" in entry:
        return "copy"
    for key in ("matmul", "conv", "elementwise", "reduction", "pooling", "generic"):
        if key in entry:
            return key
    return "other"

"""QIR as text — for dumps (``--dump-ir``) and for pass tests (before/after IR written out).

```
graph @tiny {
  %x = input() {name='x'} : f32[1,3,8,8]
  %0 = quant(%x) {qp=qp(u8, s=0.02, zp=117)} : u8[1,3,8,8]
  %1 = const() {value=array(i8, [2], [1, -1])} : i8[2]
  return %0
}
```
Attribute values are Python-literal-like: numbers (``repr``, so floats round-trip), strings,
tuples, ``qp(...)`` (QParams), ``rq(...)`` (Requant), ``term(...)`` and ``array(...)``. Arrays and
per-channel vectors longer than ``INLINE_LIMIT`` print as a digest (``#1a2b3c4d``): such text
documents a graph but cannot be parsed back into it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType, QParams, Requant, Term

INLINE_LIMIT = 16


def digest(data: np.ndarray) -> str:
    return "#" + hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()[:8]


def _vec(values: tuple[Any, ...]) -> str:
    if len(values) > INLINE_LIMIT:
        return digest(np.asarray(values)) + f"x{len(values)}"
    return "(" + ", ".join(repr(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def format_value(v: Any) -> str:
    if isinstance(v, QParams):
        return (f"qp({v.dtype.value}, s={_vec(v.scale)}, zp={_vec(v.zero_point)}, "
                f"range=({v.qmin}, {v.qmax}), axis={v.axis!r})")
    if isinstance(v, Requant):
        terms = ", ".join(format_value(t) for t in v.terms)
        return (f"rq({v.out_dtype.value}, terms=({terms},), shift={_vec(v.shift)}, "
                f"zp={v.zp_out}, range=({v.qmin}, {v.qmax}), axis={v.axis!r})")
    if isinstance(v, Term):
        return f"term(zp={v.zero_point}, m={_vec(v.multiplier)})"
    if isinstance(v, np.ndarray):
        dtype = DType.of_numpy(v.dtype).value
        body = digest(v) if v.size > INLINE_LIMIT else repr(v.reshape(-1).tolist())
        return f"array({dtype}, {list(v.shape)}, {body})"
    if isinstance(v, DType):
        return f"'{v.value}'"
    if isinstance(v, tuple | list):
        inner = ", ".join(format_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if callable(v):
        return repr(str(v))
    return repr(v)


def _type(n: Node) -> str:
    return f"{n.dtype.value}[{','.join(map(str, n.shape))}]"


def print_graph(g: Graph, *, locs: bool = False) -> str:
    names: dict[int, str] = {}
    lines = [f"graph @{g.name} {{"]
    counter = 0
    for n in g.nodes():
        if n.op is Op.INPUT:
            names[id(n)] = n.attrs.name
        else:
            names[id(n)] = str(counter)
            counter += 1
        lines.append("  " + _line(n, names, locs))
    lines.append("  return " + ", ".join("%" + names[id(o)] for o in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _line(n: Node, names: dict[int, str], locs: bool) -> str:
    args = ", ".join("%" + names[id(s)] for s in n.src)
    attrs = ", ".join(f"{k}={format_value(v)}" for k, v in n.attrs.items())
    text = f"%{names[id(n)]} = {n.op.value}({args})"
    if attrs:
        text += f" {{{attrs}}}"
    text += f" : {_type(n)}"
    if locs and n.loc:
        text += f"  loc({n.loc!r})"
    return text

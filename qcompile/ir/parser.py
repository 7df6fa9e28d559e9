"""Parse QIR text (the printer's format) back into a :class:`Graph`.

Attribute values are read with a restricted evaluator over Python's ``ast``: literals plus the
constructors ``qp``, ``rq``, ``term`` and ``array``. Nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import numpy as np

from qcompile.ir.graph import Attrs, Graph, Node, Op
from qcompile.ir.types import DType, QParams, Requant, Term

_LINE = re.compile(r"^%(?P<name>[\w.]+) = (?P<op>\w+)\((?P<args>[^)]*)\)"
                   r"(?: \{(?P<attrs>.*)\})? : (?P<dtype>\w+)\[(?P<shape>[\d,]*)\]"
                   r"(?:\s+loc\((?P<loc>.*)\))?$")


class ParseError(ValueError):
    pass


def _qp(dtype: str, *, s: tuple, zp: tuple, range: tuple, axis: int | None) -> QParams:  # noqa: A002
    return QParams(DType(dtype), tuple(float(x) for x in s), tuple(int(x) for x in zp),
                   int(range[0]), int(range[1]), axis)


def _rq(dtype: str, *, terms: tuple, shift: tuple, zp: int, range: tuple,  # noqa: A002
        axis: int | None) -> Requant:
    return Requant(tuple(terms), tuple(int(x) for x in shift), int(zp), int(range[0]),
                   int(range[1]), DType(dtype), axis)


def _term(*, zp: int, m: tuple) -> Term:
    return Term(int(zp), tuple(int(x) for x in m))


def _array(dtype: str, shape: list, values: list) -> np.ndarray:
    return np.asarray(values, dtype=DType(dtype).np).reshape(shape)


_CALLS = {"qp": _qp, "rq": _rq, "term": _term, "array": _array}


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        items = [_eval(e) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        args = [_eval(a) if not isinstance(a, ast.Name) else a.id for a in node.args]
        kwargs = {k.arg: _eval(k.value) for k in node.keywords if k.arg}
        return _CALLS[node.func.id](*args, **kwargs)
    raise ParseError(f"unsupported attribute syntax: {ast.dump(node)[:80]}")


def parse_attrs(text: str | None) -> Attrs:
    if not text:
        return Attrs()
    if "#" in text:
        raise ParseError("attributes hold a digest (#...): this dump cannot be parsed back")
    call = ast.parse(f"f({text})", mode="eval").body
    assert isinstance(call, ast.Call)
    return Attrs({k.arg: _eval(k.value) for k in call.keywords if k.arg})


def parse_graph(text: str) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    header = re.match(r"^graph @([\w.-]+) \{$", lines[0]) if lines else None
    if not header or lines[-1] != "}" or not lines[-2].startswith("return "):
        raise ParseError("expected 'graph @name {', node lines, 'return ...', '}'")
    values: dict[str, Node] = {}
    inputs = []
    for ln in lines[1:-2]:
        n, name = _parse_line(ln, values)
        values[name] = n
        if n.op is Op.INPUT:
            inputs.append(n)
    outs = tuple(values[o.strip().lstrip("%")] for o in lines[-2][len("return "):].split(","))
    return Graph(header.group(1), tuple(inputs), outs)


def _parse_line(line: str, values: dict[str, Node]) -> tuple[Node, str]:
    m = _LINE.match(line)
    if not m:
        raise ParseError(f"cannot parse line: {line}")
    try:
        src = tuple(values[a.strip().lstrip("%")] for a in m["args"].split(",") if a.strip())
    except KeyError as err:
        raise ParseError(f"use of undefined value %{err.args[0]} in: {line}") from None
    shape = tuple(int(d) for d in m["shape"].split(",") if d)
    loc = ast.literal_eval(m["loc"]) if m["loc"] else None
    return Node(Op(m["op"]), DType(m["dtype"]), shape, src, parse_attrs(m["attrs"]),
                loc), m["name"]

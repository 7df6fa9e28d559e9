"""Pass machinery: a rewrite pass is a rule ``(node, ctx) -> replacement | None`` applied to every
node in topological order, in sweeps until nothing fires (each sweep rebuilds the graph, so dead
nodes vanish). The rule sees the *current* graph (``ctx.users``) and builds its replacement from
current nodes; the engine remaps those onto the rebuilt graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import QParams

MAX_SWEEPS = 16


@dataclass
class Context:
    graph: Graph
    _users: dict[int, list[Node]] = field(default_factory=dict)

    def users(self, n: Node) -> list[Node]:
        return self._users.get(id(n), [])

    def single_user(self, n: Node) -> bool:
        return len(self.users(n)) == 1 and n not in self.graph.outputs


Rule = Callable[[Node, Context], Node | None]


class Pass:
    """A named graph transformation; ``run`` returns the new graph and how often it fired."""

    name = "pass"

    def run(self, g: Graph) -> tuple[Graph, int]:
        raise NotImplementedError


class RewritePass(Pass):
    def rule(self, n: Node, ctx: Context) -> Node | None:
        raise NotImplementedError

    def run(self, g: Graph) -> tuple[Graph, int]:
        fired_total = 0
        for _ in range(MAX_SWEEPS):
            g, fired = self._sweep(g)
            fired_total += fired
            if not fired:
                break
        return g, fired_total

    def _sweep(self, g: Graph) -> tuple[Graph, int]:
        ctx = Context(g, g.users())
        order = g.nodes()
        old = {id(n) for n in order}
        memo: dict[int, Node] = {}
        fired = 0
        for n in order:
            rep = self.rule(n, ctx) if n.op is not Op.INPUT else None
            if rep is not None:
                fired += 1
                memo[id(n)] = _remap(rep, memo, old, {})
            else:
                memo[id(n)] = _rebuild(n, memo)
        inputs = tuple(memo[id(i)] for i in g.inputs)
        return Graph(g.name, inputs, tuple(memo[id(o)] for o in g.outputs)), fired


def _rebuild(n: Node, memo: dict[int, Node]) -> Node:
    src = tuple(memo[id(s)] for s in n.src)
    if all(a is b for a, b in zip(src, n.src, strict=True)):
        return n
    return n.with_(src=src)


def _remap(n: Node, memo: dict[int, Node], old: set[int], fresh: dict[int, Node]) -> Node:
    if id(n) in old:
        return memo[id(n)]
    if id(n) in fresh:
        return fresh[id(n)]
    src = tuple(_remap(s, memo, old, fresh) for s in n.src)
    out = n if all(a is b for a, b in zip(src, n.src, strict=True)) else n.with_(src=src)
    fresh[id(n)] = out
    return out


# -- helpers shared by the rules -------------------------------------------------------------

def is_op(n: Node, *ops: Op) -> bool:
    return n.op in ops


def dequant_of(n: Node) -> QParams | None:
    """QParams of ``n`` if it is ``dequant(int8 x)``."""
    if n.op is Op.DEQUANT and n.src[0].dtype.is_int8:
        return n.attrs.qp
    return None


def same_grid(a: QParams, b: QParams) -> bool:
    """Same dtype, scales and zero points (clamp ranges may differ)."""
    return a.dtype is b.dtype and a.scale == b.scale and a.zero_point == b.zero_point and \
        a.axis == b.axis


def full_range(qp: QParams) -> bool:
    return (qp.qmin, qp.qmax) == qp.dtype.range


def quantized_producer(n: Node, ctx: Context, ops: frozenset[Op] | None = None) -> Node | None:
    """The producer ``p`` when ``n`` is ``quant(p)`` per tensor and ``p`` has no other user (and
    is one of ``ops``, when given): the root every fusion rule starts from."""
    if n.op is not Op.QUANT or not n.attrs.qp.per_tensor:
        return None
    inner = n.src[0]
    if (ops is not None and inner.op not in ops) or not ctx.single_user(inner):
        return None
    return inner

r"""dead-code

    reshape(x) to x's own shape / permute(x) by the identity / cat of one tensor  ==>  x

(Unreachable nodes need no pass: every rebuild keeps only what the outputs reach.)
"""

from __future__ import annotations

from qcompile.ir.graph import Node, Op
from qcompile.passes.base import Context, RewritePass


class DeadCode(RewritePass):
    name = "dead-code"

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if n.op is Op.RESHAPE and n.src[0].shape == n.shape and n.src[0].dtype is n.dtype:
            return n.src[0]
        if n.op is Op.PERMUTE and tuple(n.attrs.dims) == tuple(range(len(n.shape))):
            return n.src[0]
        if n.op is Op.CAT and len(n.src) == 1:
            return n.src[0]
        return None

"""One quantization step of each graph output, for "within one step of PT2E" checks.

* ``dequant(int8)`` output: its scale.
* ``dequant(i32 accumulator)`` output (logits of a classifier whose last contraction feeds float):
  the change one input code makes at the channel's largest weight, ``s_x * s_w[c] * max|W_q[c]|``
  — the smallest difference an int8 input can make at that output.
* anything else (a float fallback at the output): ``None`` (no quantized grid; not checked).
"""

from __future__ import annotations

import numpy as np

from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op


def output_step(out: Node) -> np.ndarray | None:
    if out.op is not Op.DEQUANT:
        return None
    qp = out.attrs.qp
    scale = np.asarray(qp.scale, dtype=np.float64)
    acc = out.src[0]
    if acc.op in ANCHOR_OPS and acc.op in (Op.QCONV2D, Op.QLINEAR):
        w = acc.src[1].attrs.value.reshape(acc.src[1].shape[0], -1)
        scale = scale * np.maximum(np.abs(w.astype(np.int64)).max(axis=1), 1)
    if qp.axis is None or scale.size == 1:
        return scale.reshape(())
    shape = [1] * len(out.shape)
    shape[qp.axis] = scale.size
    return scale.reshape(shape)


def output_steps(g: Graph) -> list[np.ndarray | None]:
    return [output_step(o) for o in g.outputs]


def within_steps(got: np.ndarray, want: np.ndarray, step: np.ndarray, steps: float = 1.0
                 ) -> float:
    """Fraction of elements of ``got`` within ``steps`` quantization steps of ``want``."""
    tol = steps * np.broadcast_to(step, got.shape) * (1 + 1e-6) + 1e-12
    return float(np.mean(np.abs(got.astype(np.float64) - want) <= tol))

"""Reference interpreter vs PT2E, int8 tensor by int8 tensor.

PT2E's quantize nodes give the int8 codes its float simulation produces; every QIR node that
yields int8 carries the location of the quantize it replaced (its last word is the FX node name),
so the two are compared code for code, two ways:

* ``within_one_step_fraction`` (per layer): each int8 node recomputed from PT2E's own codes of its
  int8 inputs — the compiler's rounding against PT2E's, with identical inputs. The semantics promise
  this is within one step everywhere.
* ``end_to_end_within_one_step_fraction``: the reference run on its own. One-step differences in
  early layers propagate, and networks with large noise gain (random-weight CNNs) amplify them, so
  this number is reported, not promised.

PT2E's codes are NCHW; a node the channels-last pass put in NHWC is compared with PT2E's code
transposed the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qcompile.ir.graph import Graph, Node, Op
from qcompile.passes.channels_last import TO_NHWC, is_layout_change, nhwc_values
from qcompile.reference import interpreter


def pt2e_codes(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    codes: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.op == "call_function" and "quantize_per" in str(n.target) and \
                    "dequantize" not in str(n.target):
                codes[n.name] = out.detach().numpy()
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return codes


def _fx_name(n: Node) -> str | None:
    return n.loc.split()[-1] if n.loc else None


def _code_of(n: Node, codes: dict[str, Any], nhwc: set[int]) -> np.ndarray | None:
    """PT2E's code of the int8 node ``n``, in ``n``'s layout (None when PT2E has none; a layout
    change inserted by channels-last shares its operand's location and is not compared twice)."""
    if not n.dtype.is_int8 or is_layout_change(n):
        return None
    want = codes.get(_fx_name(n) or "")
    if want is not None and id(n) in nhwc and want.ndim == 4:
        return np.ascontiguousarray(np.transpose(want, TO_NHWC))
    return want


def compare(graph: Graph, gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]
            ) -> dict[str, Any]:
    codes = pt2e_codes(gm, inputs)
    trace: dict[int, np.ndarray] = {}
    interpreter.run(graph, *[x.numpy() for x in inputs], trace=trace)
    total = close = exact = 0
    worst: list[tuple[float, str]] = []
    finals = {id(_last_int8(o)) for o in graph.outputs if _last_int8(o) is not None}
    f_total = f_close = 0
    nhwc = nhwc_values(graph)
    for n in graph.nodes():
        if not n.dtype.is_int8 or n.op in (Op.CONST, Op.INPUT):
            continue
        want = _code_of(n, codes, nhwc)
        if want is None or want.shape != trace[id(n)].shape:
            continue
        diff = np.abs(trace[id(n)].astype(np.int64) - want.astype(np.int64))
        total, close, exact = total + diff.size, close + int(np.sum(diff <= 1)), \
            exact + int(np.sum(diff == 0))
        worst.append((float(np.mean(diff <= 1)), n.loc or "?"))
        if id(n) in finals:
            f_total, f_close = f_total + diff.size, f_close + int(np.sum(diff <= 1))
    worst.sort()
    local = _per_layer(graph, codes, nhwc, trace)
    return {**local,
            "end_to_end_within_one_step_fraction": close / total if total else None,
            "end_to_end_exact_fraction": exact / total if total else None,
            "final_within_one_step_fraction": f_close / f_total if f_total else None,
            "end_to_end_worst": [{"loc": loc, "within_one_step": frac}
                                 for frac, loc in worst[:5]]}


def _per_layer(graph: Graph, codes: dict[str, Any], nhwc: set[int],
               trace: dict[int, np.ndarray]) -> dict[str, Any]:
    def value(n: Node, memo: dict[int, np.ndarray]) -> np.ndarray:
        if n.op is Op.CONST:
            return n.attrs.value
        if n.op is Op.INPUT:               # e.g. the integer attention mask of a mask_lut
            return trace[id(n)]
        if (code := _code_of(n, codes, nhwc)) is not None:
            return code
        if id(n) not in memo:
            memo[id(n)] = interpreter.execute(n, [value(s, memo) for s in n.src])
        return memo[id(n)]

    total = close = exact = 0
    worst: list[tuple[float, str]] = []
    for n in graph.nodes():
        want = _code_of(n, codes, nhwc)
        if want is None or n.op in (Op.CONST, Op.INPUT, Op.QUANT):
            continue
        got = interpreter.execute(n, [value(s, {}) for s in n.src])
        if got.shape != want.shape:
            continue
        diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
        total, close = total + diff.size, close + int(np.sum(diff <= 1))
        exact += int(np.sum(diff == 0))
        worst.append((float(np.mean(diff <= 1)), n.loc or "?"))
    worst.sort()
    return {"within_one_step_fraction": close / total if total else None,
            "exact_fraction": exact / total if total else None,
            "compared_elements": total, "compared_tensors": len(worst),
            "worst": [{"loc": loc, "within_one_step": frac} for frac, loc in worst[:3]]}


def _last_int8(n: Node) -> Node | None:
    """The int8 tensor an output is computed from (through its dequantize/contraction)."""
    while not n.dtype.is_int8:
        if not n.src or n.op is Op.INPUT:
            return None
        n = n.src[0]
    return n


def vs_reference(runner: Any, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """A compiled runner (``cpu``) against the reference interpreter, element for element, at
    every compiled batch size (each module on the first ``b`` samples of ``inputs``). Integer
    chains must match exactly; float islands (layer_norm, softmax, ...) may differ in the last
    bits, which ``max_abs_diff`` shows."""
    arrays = [x.detach().numpy() for x in inputs]
    per_batch: dict[str, dict[str, int]] = {}
    for b, module in sorted(runner.modules.items()):
        if b > arrays[0].shape[0] or module.graph is None:
            continue
        piece = [x[:b] for x in arrays]
        got = module.module()(*piece)
        want = interpreter.run(module.graph, *piece)
        mismatched = diff = 0
        for g, w in zip(got, want, strict=True):
            g = g.view(w.dtype) if g.dtype.itemsize == w.dtype.itemsize else g
            mismatched += int(np.count_nonzero(g != w))
            diff = max(diff, float(np.max(np.abs(g.astype(np.float64) - w), initial=0.0)))
        per_batch[str(b)] = {"mismatched": mismatched, "total": int(sum(w.size for w in want)),
                             "max_abs_diff": diff}
    return {"mismatched": sum(r["mismatched"] for r in per_batch.values()),
            "total": sum(r["total"] for r in per_batch.values()),
            "max_abs_diff": max((r["max_abs_diff"] for r in per_batch.values()), default=0.0),
            "per_batch": per_batch}

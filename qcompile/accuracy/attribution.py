"""Per-chain accuracy attribution: for every fused chain (an integer anchor and its requantize, or
its dequantize for chains that feed float), the SQNR of its output against the float model's
matching tensor and against PT2E's, so a user sees at once where accuracy goes and whether a drop
is quantization error (PT2E loses it too) or a compiler error (the chain departs from PT2E).

Matching is by source: the chain's last node carries the location of the PT2E node it replaced,
whose last word is the FX node name (a quantize for requantize chains; the contraction itself
for dequantize chains). PT2E's value is that quantize's code, dequantized with its own scale and
zero point (the chain's code is dequantized with the same ones), or the contraction's float
output. The float model's value is the same FX node's output in the float model exported the
same way (PT2E keeps the exported node names): the quantize's input, or the contraction, followed
through a batch norm PT2E folded into the convolution before it.

Two comparisons with PT2E: end to end (the reference interpreter runs the whole graph on its own,
as it runs in production, so one-step differences of earlier chains propagate) and local (the
chain recomputed from PT2E's own codes of its inputs: its error alone). A chain is
*compiler*-dominated when its local departure from PT2E is larger than PT2E's own error against
float, else *quantization*-dominated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qcompile.accuracy.metrics import sqnr_db
from qcompile.frontend.quantize import QuantizedModel, export_model, op_name
from qcompile.ir.graph import Graph, Node, Op
from qcompile.passes.channels_last import TO_NHWC, nhwc_values
from qcompile.passes.residency import _chain
from qcompile.reference import interpreter

FOLDED = frozenset({"batch_norm", "_native_batch_norm_legit_no_training"})


@dataclass(frozen=True)
class _Pt2eValue:
    value: np.ndarray               # float (dequantized code, or a float output)
    scale: np.ndarray | None        # the quantize's scale and zero point (None: float output)
    zero_point: np.ndarray | None
    float_name: str                 # the float model's node holding the matching tensor


def _fx_name(n: Node) -> str:
    return n.loc.split()[-1] if n.loc else ""


def chain_outputs(graph: Graph) -> list[Node]:
    """The last node of every fused chain, in graph order."""
    return [n for n in graph.nodes() if _chain(n) is not None]


def _record(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], wanted: set[str]
            ) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Outputs (and concrete arguments) of the nodes named in ``wanted``."""
    found: dict[str, tuple[Any, tuple[Any, ...]]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in wanted:
                args, _ = self.fetch_args_kwargs_from_env(n)
                found[n.name] = (out, args)
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return found


def _is_quantize(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and "quantize_per" in str(n.target) and \
        "dequantize" not in str(n.target)


def _pt2e_values(q: QuantizedModel, names: set[str], inputs: tuple[torch.Tensor, ...]
                 ) -> dict[str, _Pt2eValue]:
    nodes = {n.name: n for n in q.module.graph.nodes if n.name in names}
    recorded = _record(q.module, inputs, set(nodes))
    values: dict[str, _Pt2eValue] = {}
    for name, (out, args) in recorded.items():
        n = nodes[name]
        if _is_quantize(n) and isinstance(n.args[0], torch.fx.Node):
            scale, zp, _ = _qparams(args, out.dim())
            real = (out.double().numpy() - zp) * scale
            values[name] = _Pt2eValue(real, scale, zp, n.args[0].name)
        elif isinstance(out, torch.Tensor) and out.is_floating_point():
            values[name] = _Pt2eValue(out.double().numpy(), None, None, name)
    return values


def _qparams(args: tuple[Any, ...], ndim: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Scale and zero point of a quantize call, shaped to broadcast (per channel: its axis)."""
    scale = np.asarray(torch.as_tensor(args[1]).double().numpy())
    zp = np.asarray(torch.as_tensor(args[2]).double().numpy())
    if scale.size == 1:
        return scale.reshape(()), zp.reshape(()), None
    axis = int(args[3])
    shape = [1] * ndim
    shape[axis] = scale.size
    return scale.reshape(shape), zp.reshape(shape), axis


def _float_values(q: QuantizedModel, names: set[str], inputs: tuple[torch.Tensor, ...]
                  ) -> dict[str, np.ndarray]:
    """The float model's tensors at ``names``, each followed through a batch norm PT2E folded
    into its producer (conv → bn: PT2E's conv output is the float model's bn output)."""
    from qcompile.frontend.quantize import _prepared_graph

    exported, _ = export_model(q.float_module, q.example_inputs, max_batch=q.config.max_batch)
    gm = _prepared_graph(exported)
    by_name = {n.name: n for n in gm.graph.nodes}
    follow = {}
    for name in names:
        n = by_name.get(name)
        while n is not None and len(n.users) == 1 and op_name(next(iter(n.users))) in FOLDED:
            n = next(iter(n.users))
            if op_name(n) != "batch_norm":   # (out, mean, invstd): its first item
                n = next((u for u in n.users if u.args[1:] == (0,)), None)
        if n is not None:
            follow[name] = n.name
    recorded = _record(gm, inputs, set(follow.values()))
    return {name: recorded[f][0].double().numpy() for name, f in follow.items()
            if f in recorded and isinstance(recorded[f][0], torch.Tensor)}


def _as_layout(value: np.ndarray | None, nhwc: bool, shape: tuple[int, ...]
               ) -> np.ndarray | None:
    if value is None:
        return None
    if nhwc and value.ndim == 4:
        value = np.transpose(value, TO_NHWC)
    return value if value.shape == shape else None


def attribution(graph: Graph, q: QuantizedModel, inputs: tuple[torch.Tensor, ...]
                ) -> dict[str, Any]:
    """Per-chain SQNR of ``graph`` (post-pipeline QIR at the batch of ``inputs``) against the
    float model and PT2E; see the module docstring."""
    ends = chain_outputs(graph)
    trace: dict[int, np.ndarray] = {}
    interpreter.run(graph, *[x.numpy() for x in inputs], trace=trace)
    pt2e = _pt2e_values(q, {_fx_name(n) for n in ends}, inputs)
    flt = _float_values(q, {v.float_name for v in pt2e.values()}, inputs)
    nhwc = nhwc_values(graph)
    local = _local_values(graph, ends, q, inputs, nhwc)
    rows = [_row(n, trace[id(n)], local[id(n)], pt2e.get(_fx_name(n)), flt, id(n) in nhwc)
            for n in ends]
    return {"chains": rows, "inputs": int(inputs[0].shape[0]),
            "worst_vs_float": _worst(rows, "sqnr_vs_float_db"),
            "worst_vs_pt2e": _worst(rows, "sqnr_vs_pt2e_db"),
            "compiler_dominated": sum(r["dominant"] == "compiler" for r in rows)}


def _local_values(graph: Graph, ends: list[Node], q: QuantizedModel,
                  inputs: tuple[torch.Tensor, ...], nhwc: set[int]) -> dict[int, np.ndarray]:
    """Each chain recomputed from PT2E's own codes of its int8 inputs: its error alone, without
    the one-step differences the chains before it pass on."""
    from qcompile.accuracy.exactness import _code_of, pt2e_codes

    codes = pt2e_codes(q.module, inputs)
    memo: dict[int, np.ndarray] = {id(n): x.numpy() for n, x in zip(graph.inputs, inputs,
                                                                   strict=True)}

    def value(n: Node) -> np.ndarray:
        if n.op is Op.CONST:
            return n.attrs.value
        code = _code_of(n, codes, nhwc)
        if code is not None:
            return code
        if id(n) not in memo:
            memo[id(n)] = interpreter.execute(n, [value(s) for s in n.src])
        return memo[id(n)]

    return {id(n): interpreter.execute(n, [value(s) for s in n.src]) for n in ends}


def _row(n: Node, got: np.ndarray, local: np.ndarray, p: _Pt2eValue | None,
         flt: dict[str, np.ndarray], nhwc: bool) -> dict[str, Any]:
    info = _chain(n) or {}
    row: dict[str, Any] = {"loc": info.get("loc"), "matched": _fx_name(n),
                           "ops": info.get("ops"), "out": n.dtype.value, "shape": list(n.shape),
                           "sqnr_vs_float_db": None, "sqnr_vs_pt2e_db": None,
                           "sqnr_vs_pt2e_local_db": None, "pt2e_sqnr_vs_float_db": None,
                           "dominant": None}
    if p is None:
        return row
    scale = None if p.scale is None else _as_layout(np.broadcast_to(p.scale, p.value.shape),
                                                    nhwc, n.shape)
    zp = None if p.zero_point is None else _as_layout(
        np.broadcast_to(p.zero_point, p.value.shape), nhwc, n.shape)
    want = _as_layout(p.value, nhwc, n.shape)
    if want is None:
        return row
    def real(v: np.ndarray) -> np.ndarray:
        return v.astype(np.float64) if scale is None else (v.astype(np.float64) - zp) * scale

    ref = _as_layout(flt.get(p.float_name), nhwc, n.shape)
    row["sqnr_vs_pt2e_db"] = sqnr_db(want, real(got))
    row["sqnr_vs_pt2e_local_db"] = sqnr_db(want, real(local))
    if ref is not None:
        row["sqnr_vs_float_db"] = sqnr_db(ref, real(got))
        row["pt2e_sqnr_vs_float_db"] = sqnr_db(ref, want)
        # this chain's own departure from PT2E against PT2E's own error: which is larger?
        row["dominant"] = "compiler" if row["sqnr_vs_pt2e_local_db"] < \
            row["pt2e_sqnr_vs_float_db"] else "quantization"
    return row


def _worst(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    measured = [r for r in rows if r[key] is not None]
    if not measured:
        return None
    r = min(measured, key=lambda r: r[key])
    return {"loc": r["loc"], key: r[key]}

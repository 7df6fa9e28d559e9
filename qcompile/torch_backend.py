"""``torch.compile(model, backend="qcompile")`` for models already converted with PT2E.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``). Dynamo hands the
backend one FX graph per region between graph breaks. For each region:

* the placeholders Dynamo lifted from the module (PT2E's frozen int8 weights, scales, zero points,
  biases) become constants again (``get_attr``), as in the PT2E ``GraphModule`` itself, so the
  importer sees ``dequantize(const int8)`` weights and the pass pipeline fuses the same chains;
* symbolic sizes (a batch dimension Dynamo made dynamic) are specialised: QIR is static-shaped,
  so one module is compiled per concrete input signature seen, and cached;
* the graph is imported to QIR (:func:`qcompile.frontend.importer.import_graph`), run through the
  default pass pipeline and compiled for target ``cpu`` (IREE) — or ``ort``/``reference`` with
  ``options={"target": ...}``.

A region that cannot be compiled — no quantize op in it (a float region after a graph break),
an op the importer or a pass rejects, a compile failure — runs eagerly (the FX graph as Dynamo
traced it); the reason is logged as a warning and kept in :func:`regions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("qcompile")

TARGETS = ("cpu", "ort", "reference")
_REGIONS: list[Region] = []


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
            options: dict[str, Any] | None = None, **_: Any) -> Callable[..., Any]:
    """The Dynamo backend: returns the callable that runs ``gm``'s region."""
    region = Region(gm, list(example_inputs), _options(options), index=len(_REGIONS))
    _REGIONS.append(region)
    region.prepare(example_inputs)
    return region


def regions() -> list[dict[str, Any]]:
    """What the backend did with every region it was given (this process, since
    :func:`reset`): ``status`` ``compiled`` or ``eager``, the ``reason`` for eager, the compiled
    input signatures, the target and the fused-chain count."""
    return [r.record() for r in _REGIONS]


def reset() -> None:
    _REGIONS.clear()


def _options(options: dict[str, Any] | None) -> dict[str, Any]:
    from qcompile.errors import RecipeError

    opts = {"target": "cpu", "float_ops": "fallback", **(options or {})}
    unknown = set(opts) - {"target", "float_ops"}
    if unknown or opts["target"] not in TARGETS:
        raise RecipeError(
            "torch.compile(backend='qcompile') got options it does not know",
            at=f"options={options!r}",
            why=f"known options: target ({', '.join(TARGETS)}), float_ops (fallback, error)",
            next="pass e.g. options={'target': 'cpu'}")
    return opts


@dataclass
class Compiled:
    run: Callable[..., Any]
    chains: int
    float_ops: int


@dataclass
class Region:
    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    options: dict[str, Any]
    index: int
    eager_reason: str | None = None
    compiled: dict[tuple[Any, ...], Compiled] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.module_state = {i for i, n in enumerate(self.placeholders) if _is_module_state(n)}

    def prepare(self, example_inputs: Sequence[Any]) -> None:
        """Compile now when the examples are concrete (static shapes), else at the first call."""
        if not _has_quantize(self.gm):
            self._eager("no PT2E quantize op in this region (a float region, e.g. after a "
                        "graph break): nothing for qcompile to compile")
        elif all(not isinstance(a, torch.SymInt) for a in example_inputs):
            self._compile(list(example_inputs))

    def __call__(self, *args: Any) -> Any:
        if self.eager_reason is None:
            key = self._key(args)
            entry = self.compiled.get(key) or self._compile(list(args))
            if entry is not None:
                return entry.run(*args)
        return self.gm(*args)

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else int(a)
                     for i, a in enumerate(args) if i not in self.module_state)

    def _compile(self, args: list[Any]) -> Compiled | None:
        try:
            entry = self._build(args)
        except Exception as err:  # noqa: BLE001 - any failure means "run this region eagerly"
            self._eager(f"{type(err).__name__}: {str(err).strip()}")
            return None
        self.compiled[self._key(args)] = entry
        return entry

    def _build(self, args: list[Any]) -> Compiled:
        from qcompile.passes.pipeline import default_pipeline, run_pipeline
        from qcompile.passes.residency import residency

        gm, inputs, positions = specialise(self.gm, args, self.module_state)
        from qcompile.frontend.importer import import_graph

        graph = import_graph(gm, tuple(inputs), name=f"region{self.index}")
        lowered = run_pipeline(graph, default_pipeline(self.options["float_ops"])).graph
        runner = _runner(self.options["target"], lowered, int(inputs[0].shape[0]))
        res = residency(lowered)
        structure = self.gm.graph.output_node().args[0]

        def run(*call_args: Any) -> Any:
            outs = runner(*[call_args[i].contiguous() for i in positions])
            return _unflatten(structure, iter(outs if isinstance(outs, tuple) else (outs,)))

        return Compiled(run, res["chain_count"], res["float_ops_inside"])

    def _eager(self, reason: str) -> None:
        self.eager_reason = reason
        log.warning("torch.compile(backend='qcompile'): region %d runs eagerly: %s", self.index,
                    reason.splitlines()[0])

    def record(self) -> dict[str, Any]:
        nodes = [n for n in self.gm.graph.nodes if n.op == "call_function"]
        return {"region": self.index, "status": "eager" if self.eager_reason else "compiled",
                "reason": self.eager_reason, "target": self.options["target"],
                "ops": len(nodes),
                "signatures": [[list(k[0]) if isinstance(k, tuple) else k for k in key]
                               for key in self.compiled],
                "chains": max((c.chains for c in self.compiled.values()), default=0)}


def specialise(gm: torch.fx.GraphModule, args: Sequence[Any], module_state: set[int]
               ) -> tuple[torch.fx.GraphModule, list[torch.Tensor], list[int]]:
    """A copy of ``gm`` whose module-state placeholders are constants (``get_attr``) and whose
    symbolic sizes are the ints of ``args``; returns it, its tensor inputs and their positions
    in ``args``."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[torch.Tensor] = []
    positions: list[int] = []
    i = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda x: env[x])
            continue
        a = args[i]
        if i in module_state:
            name = f"_qc_state{i}"
            root.register_buffer(name, a.detach())
            env[n] = graph.get_attr(name)
        elif isinstance(a, torch.Tensor):
            env[n] = graph.placeholder(n.name)
            inputs.append(a.detach())
            positions.append(i)
        else:
            env[n] = int(a)   # a symbolic size: this module is specialised to its value
        i += 1
    return torch.fx.GraphModule(root, graph), inputs, positions


def _is_module_state(n: torch.fx.Node) -> bool:
    """A placeholder Dynamo lifted from an ``nn.Module`` (parameter or buffer), not a user
    input."""
    source = getattr(n.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    gs = source.guard_source
    return bool(gs.is_specialized_nn_module() or gs.is_unspecialized_nn_module())


def _has_quantize(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and "quantize_per" in str(n.target)
               and "dequantize" not in str(n.target) for n in gm.graph.nodes)


def _unflatten(structure: Any, flat: Any) -> Any:
    """The graph's output structure (tuples/lists of nodes) with the flat outputs in place."""
    if isinstance(structure, list | tuple):
        return type(structure)(_unflatten(s, flat) for s in structure)
    return next(flat)


def _runner(target: str, graph: Any, batch: int) -> Callable[..., Any]:
    if target == "cpu":
        from qcompile.codegen import cpu

        return cpu.build({batch: graph})[0]
    if target == "ort":
        from qcompile.codegen.ort.target import build

        return build({batch: graph})[0]
    from qcompile.reference import interpreter

    def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(o.copy()) for o in interpreter.run(
            graph, *[x.detach().numpy() for x in xs]))

    return run

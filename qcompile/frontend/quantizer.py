r"""The qcompile PT2E quantizer: annotate for the longest int8 chains our compiler runs.

torchao's ``X86InductorQuantizer`` annotates for oneDNN: conv/linear(+add)(+relu) patterns, and it
quantizes a pool or a flatten only when its input already is. Whatever it leaves between two float
ops is a float island our compiler must fall back for. :class:`QCompileQuantizer` starts from that
annotation (weights, conv/linear fusion patterns) and extends it::

    x86:       conv+add+relu ──f32──▶ avgpool ──f32──▶ flatten ──Q──▶ linear
    qcompile:  conv+add+relu ──Q──▶ avgpool ──Q──▶ flatten ──(shared Q)──▶ linear

1. the output of every conv/linear/matmul chain is quantized when anything but the graph output
   reads it (the conv output inside a conv→add→relu chain stays float: the chain fuses);
2. every op the compiler runs in int8 gets quantized inputs and output: data movement and max
   pooling share their input's scale and zero point (no rescale), ``cat`` shares one for all of
   its inputs; pools, means, unary elementwise ops (lookup tables), add/mul, matmul/bmm and the
   float islands softmax/layer_norm get their own output observer;
3. an additive attention mask (a bias computed from the integer mask input only, added to the
   scores right before softmax) stays float: calibrated on unpadded text its range is [0, 0],
   and calibrated on padded text its -10000 would spend all 256 levels on one value. The softmax
   input is observed in a window below each row's maximum instead, so masked logits clamp to the
   window floor, where e^-16 makes them vanish just as e^-10000 does.

4. a relu/clamp right after a conv/linear/matmul chain that x86 did not fuse (functional
   ``torch.relu``, ``relu6``) joins the chain: no quantize between the two.

Modules given ``set_module_name_qconfig(name, None)`` stay float, as with the x86 quantizer;
``float_residual_stream=True`` keeps a transformer's residual stream float (see the class).
:func:`float_islands` lists what a converted graph still computes in float.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from typing import Any

import torch
from torch.fx import GraphModule, Node

from calibration._quiet import quiet_torchao
from qcompile.frontend.quantize import DEQUANT_OPS, QUANT_OPS, op_name

with quiet_torchao():
    from torchao.quantization.pt2e.quantizer import (
        QuantizationAnnotation,
        QuantizationConfig,
        QuantizationSpec,
        Quantizer,
        SharedQuantizationSpec,
        get_module_name_filter,
    )
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

__all__ = ["QCompileQuantizer", "float_islands", "windowed"]

KEY = "quantization_annotation"

_TORCH_DIR = os.path.dirname(torch.__file__)  # frames inside torch are not the model's code
SOFTMAX_WINDOW = 16.0  # observe softmax inputs within [row max - 16, row max]: e^-16 ≈ 1e-7

ANCHORS = frozenset({"conv1d", "conv2d", "linear", "matmul", "bmm"})
CHAIN_ACTS = frozenset({"relu", "relu6", "hardtanh", "clamp"})  # fold into the requant clamp
SHARED = frozenset({"max_pool2d", "flatten", "view", "reshape", "_unsafe_view", "permute",
                    "transpose", "t", "unsqueeze", "squeeze", "pad", "constant_pad_nd"})
RESCALED = frozenset({"avg_pool2d", "adaptive_avg_pool2d", "mean", "softmax", "_softmax",
                      "layer_norm"})
UNARY = frozenset({"relu", "relu6", "hardtanh", "clamp", "hardswish", "hardsigmoid", "silu",
                   "gelu", "sigmoid", "tanh", "elu", "leaky_relu", "mish", "softplus", "erf",
                   "exp", "neg", "abs", "sqrt", "rsqrt", "reciprocal"})
SCALAR_ARITH = frozenset({"add", "sub", "mul", "div", "rsub"})  # tensor ∘ number: a lookup table
BINARY = frozenset({"add", "mul"})
CAT = frozenset({"cat", "concat"})
SOFTMAX = frozenset({"softmax", "_softmax"})


class QCompileQuantizer(Quantizer):
    """PT2E quantizer for qcompile's int8 chains (see the module docstring).

    Same configuration surface as ``X86InductorQuantizer``: :meth:`set_global` and
    :meth:`set_module_name_qconfig` (``None`` keeps a module in float).

    ``float_residual_stream=True`` keeps a transformer's residual stream in float: the sum
    ``x + sublayer(x)`` feeding a LayerNorm and the LayerNorm output read back as the next
    residual are not quantized (everything else stays int8). Per-tensor int8 cannot hold the
    outlier features of real checkpoints there (MiniLM's pre-LayerNorm sums reach ±190 while
    most features are below 1; Bondarenko et al., EMNLP 2021, locate the loss at this point).
    """

    def __init__(self, *, float_residual_stream: bool = False) -> None:
        super().__init__()
        self.global_config: QuantizationConfig | None = None
        self.module_name_qconfig: dict[str, QuantizationConfig | None] = {}
        self.float_residual_stream = float_residual_stream

    def set_global(self, config: QuantizationConfig) -> QCompileQuantizer:
        self.global_config = config
        return self

    def set_module_name_qconfig(self, module_name: str,
                                config: QuantizationConfig | None) -> QCompileQuantizer:
        self.module_name_qconfig[module_name] = config
        return self

    def annotate(self, model: GraphModule) -> GraphModule:
        """x86 annotation first, then the extension of the module docstring, node by node."""
        with warnings.catch_warnings():
            # the x86 recipe skips such a maxpool; we annotate it below
            warnings.filterwarnings("ignore", message="The input of maxpool2d is not quantized")
            self._x86().annotate(model)
        _Annotator(model.graph, self._activation_spec, self.float_residual_stream).run()
        return model

    def validate(self, model: GraphModule) -> None:
        pass

    def _x86(self) -> X86InductorQuantizer:
        x86 = X86InductorQuantizer()
        if self.global_config is not None:
            x86.set_global(self.global_config)
        for name, config in self.module_name_qconfig.items():
            x86.set_module_name_qconfig(name, config)
        return x86

    def _activation_spec(self, node: Node) -> QuantizationSpec | None:
        """The activation spec of ``node``'s config (module name first, then global); ``None``
        for a module kept in float."""
        config = self.global_config
        for name, module_config in self.module_name_qconfig.items():
            if get_module_name_filter(name)(node):
                config = module_config
                break
        return None if config is None else config.input_activation


class _Annotator:
    """One pass over an x86-annotated graph, in topological order (producers first)."""

    def __init__(self, graph: torch.fx.Graph, spec_of: Any, float_residual: bool) -> None:
        self.graph, self.spec_of = graph, spec_of
        self.derived = _input_derived(graph)
        self.masks = _mask_operands(graph, self.derived)
        self.residual = _residual_stream(graph) if float_residual else set()
        self.absorbed: set[Node] = set()  # relu/clamp ops fused into their producer's chain
        self.chain_adds = {n for n in graph.nodes if op_name(n) == "add" and _is_annotated(n)
                           and any(isinstance(a, Node) and _is_fused_anchor(a) for a in n.args)}

    def run(self) -> None:
        for node in self.graph.nodes:
            act = self.spec_of(node)
            if act is None or node.op != "call_function":
                continue
            if _is_annotated(node):
                self.extend_x86(node, act)
            elif node not in self.derived:  # mask/position arithmetic on integer inputs
                self.annotate_op(node, act)

    def int8_readers(self, node: Node) -> list[Node]:
        """Users that want ``node`` quantized: all but the graph output and float (skipped) ops."""
        return [u for u in node.users if u.op != "output" and self.spec_of(u) is not None
                and isinstance(_val(u), torch.Tensor)]  # not sym_size and other shape queries

    def output_spec(self, node: Node, spec: Any) -> Any:
        """``spec`` if some op reads ``node`` in int8, else ``None`` (float graph output, a
        chain that goes on into a relu/clamp, the float residual stream)."""
        readers = self.int8_readers(node)
        if not readers or node in self.residual or self.absorb_act(node):
            return None
        if any(_is_softmax_input(node, u) for u in readers) and isinstance(spec, QuantizationSpec):
            return windowed(spec)
        return spec

    def absorb_act(self, node: Node) -> bool:
        """A chain output read only by a relu/clamp x86 did not fuse: the act joins the chain
        (quantizing in between would cost a rounding and half the levels on negatives)."""
        users = list(node.users)
        act = users[0] if len(users) == 1 else None
        if act is None or op_name(act) not in CHAIN_ACTS or _is_annotated(act) \
                or act.args[0] is not node or self.spec_of(act) is None:
            return False
        if not (op_name(node) in ANCHORS or op_name(node) == "add" and node in self.chain_adds):
            return False
        self.absorbed.add(act)
        return True

    def extend_x86(self, node: Node, act: QuantizationSpec) -> None:
        """Quantize the residual of x86's linear+add (it leaves it float) and the output of a
        pattern x86 leaves unquantized when its consumer does not ask for int8."""
        ann = node.meta[KEY]
        if op_name(node) == "add":
            for arg in _float_args(node):
                if arg not in ann.input_qspec_map and not _is_fused_anchor(arg) \
                        and arg not in self.residual:
                    ann.input_qspec_map[arg] = act
        if _is_pattern_output(ann) and ann.output_qspec is None and _is_float(node):
            ann.output_qspec = self.output_spec(node, act)

    def annotate_op(self, node: Node, act: QuantizationSpec) -> None:
        """Annotate an op x86 left alone by its role (module docstring, points 2-4)."""
        name, args = op_name(node), _float_args(node)
        inputs: dict[Node, Any]
        output: Any
        if not args:
            return
        if node in self.absorbed:
            inputs, output = {}, act
        elif name in CAT:
            first = args[0]
            inputs = {a: SharedQuantizationSpec((first, node)) for a in args}
            inputs[first] = act
            output = SharedQuantizationSpec((first, node))
        elif name in SHARED and _shares_qparams(node):
            inputs, output = {args[0]: act}, SharedQuantizationSpec((args[0], node))
        elif _own_output_role(node, name, args):
            keep_float = {self.masks.get(node)} | self.residual
            inputs = {a: act for a in args if a not in keep_float}
            if name in SOFTMAX and _softmax_on_last_dim(node):
                inputs[args[0]] = windowed(act)
            output = act
        else:
            return
        node.meta[KEY] = QuantizationAnnotation(
            input_qspec_map=inputs, output_qspec=self.output_spec(node, output), _annotated=True)


def _own_output_role(node: Node, name: str, args: list[Node]) -> bool:
    """Ops that read int8 and write int8 with their own output scale."""
    if name in RESCALED or name in UNARY:
        return _float_args(node)[:1] == [node.args[0]]  # only the data input is quantized
    if name in SCALAR_ARITH and len(args) == 1:
        return len(node.args) == 2 and isinstance(node.args[1 - node.args.index(args[0])],
                                                  int | float)
    operands = [a for a in node.args[:2] if isinstance(a, Node)]
    return (name in BINARY or name in ("matmul", "bmm")) and len(operands) == 2 \
        and all(a in args for a in operands)


def _shares_qparams(node: Node) -> bool:
    """Data movement keeps the input's scale; a pad does only when it pads with 0.0 (which the
    zero point represents exactly)."""
    if op_name(node) in ("pad", "constant_pad_nd"):
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
        return not value and (len(node.args) < 2 or op_name(node) == "constant_pad_nd"
                              or node.args[1] in (None, "constant"))
    return True


# ---------------------------------------------------------------------------------------------
# graph facts


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_float(node: Any) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _float_args(node: Node) -> list[Node]:
    """Float tensor inputs, in order, without duplicates (``cat`` reads a list)."""
    flat: list[Any] = []
    for arg in node.args:
        flat.extend(arg if isinstance(arg, list | tuple) else [arg])
    if op_name(node) == "layer_norm":
        flat = flat[:1]  # weight and bias are parameters, not activations
    return list(dict.fromkeys(a for a in flat if _is_float(a)))


def _is_annotated(node: Node) -> bool:
    ann = node.meta.get(KEY)
    return ann is not None and ann._annotated


def _is_pattern_output(ann: QuantizationAnnotation) -> bool:
    return bool(getattr(ann, "_is_output_of_quantized_pattern", False))


def _is_fused_anchor(node: Node) -> bool:
    """A conv/linear x86 fused into a following add (its output feeds the add unquantized)."""
    ann = node.meta.get(KEY)
    return op_name(node) in ANCHORS and ann is not None and not _is_pattern_output(ann) \
        and ann.output_qspec is None


def _softmax_on_last_dim(node: Node) -> bool:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    val = _val(node.args[0])
    return isinstance(dim, int) and val is not None and dim % max(val.dim(), 1) == val.dim() - 1


def _is_softmax_input(node: Node, user: Node) -> bool:
    return op_name(user) in SOFTMAX and user.args[0] is node and _softmax_on_last_dim(user)


def _input_derived(graph: torch.fx.Graph) -> set[Node]:
    """Nodes computed from the integer graph inputs alone, without a parameter or a quantized
    value on the way: attention-mask and position arithmetic on ``attention_mask``/ids."""
    derived: set[Node] = set()
    for node in graph.nodes:
        integer_input = node.op == "placeholder" and not _is_float(node)
        computed = node.op == "call_function" and op_name(node) not in QUANT_OPS | DEQUANT_OPS \
            and all(a in derived for a in node.all_input_nodes)
        if integer_input or computed:
            derived.add(node)
    return derived


def _mask_operands(graph: torch.fx.Graph, derived: set[Node]) -> dict[Node, Node]:
    """``add`` → its additive-mask operand, for adds of scores and a mask bias read by softmax."""
    masks = {}
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) != "add" or not node.users:
            continue
        args = _float_args(node)
        if len(args) == 2 and all(op_name(u) in SOFTMAX for u in node.users):
            mask = [a for a in args if a in derived]
            if len(mask) == 1:
                masks[node] = mask[0]
    return masks


def _residual_stream(graph: torch.fx.Graph) -> set[Node]:
    """Residual sums read by a LayerNorm, and LayerNorm outputs read back by a residual sum."""
    norms = [n for n in graph.nodes if op_name(n) == "layer_norm"]
    sums = {n.args[0] for n in norms if isinstance(n.args[0], Node) and op_name(n.args[0]) == "add"}
    return sums | {n for n in norms if any(u in sums for u in n.users)}


# ---------------------------------------------------------------------------------------------
# the softmax-input observer


def windowed(spec: QuantizationSpec) -> QuantizationSpec:
    """``spec`` observing only the top ``SOFTMAX_WINDOW`` below each row's max (last dim)."""
    ctr = spec.observer_or_fake_quant_ctr
    partial = getattr(ctr, "p", None)
    if not isinstance(partial, functools.partial) or getattr(ctr, "callable_args", None):
        return spec
    new_ctr = _windowed_class(partial.func).with_args(*partial.args, **partial.keywords)
    return dataclasses.replace(spec, observer_or_fake_quant_ctr=new_ctr)


@functools.cache
def _windowed_class(base: Any) -> Any:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() and x.numel():
            base.forward(self, torch.maximum(x, x.amax(-1, keepdim=True) - SOFTMAX_WINDOW))
        return x

    name = f"SoftmaxWindow{base.__name__}"
    cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls  # importable by name, so prepared models stay picklable
    return cls


# ---------------------------------------------------------------------------------------------
# what a converted graph still computes in float


def float_islands(gm: GraphModule) -> list[dict[str, Any]]:
    """Float compute nodes of a converted graph that no int8 pattern covers.

    A node is listed when its float output flows into another compute node (not a quantize),
    except along a fusable ``conv/linear/matmul (dq inputs) → add → relu/clamp`` chain and except
    the computation of the graph output itself (e.g. float logits). Each entry: ``name``, ``op``,
    ``consumers``, ``module`` (innermost ``nn_module_stack`` entry), ``location`` (last frame of
    ``stack_trace``) and ``reason``: ``input-derived`` (computed from graph inputs alone, like an
    attention-mask bias), ``float weights`` (a conv/linear kept float) or ``float activation``.
    """
    tail = _output_tail(gm.graph)
    derived = _input_derived(gm.graph)
    islands = []
    for node in gm.graph.nodes:
        if not _is_compute(node) or not _is_float(node) or node in tail:
            continue
        consumers = [u for u in node.users if _is_compute(u) and not _fuses(node, u)]
        if consumers:
            islands.append({
                "name": node.name, "op": op_name(node), "consumers": [u.name for u in consumers],
                "module": _module(node), "location": _location(node),
                "reason": _island_reason(node, derived)})
    return islands


def _is_compute(node: Node) -> bool:
    return node.op == "call_function" and op_name(node) not in QUANT_OPS | DEQUANT_OPS \
        and isinstance(_val(node), torch.Tensor)


def _is_dequantized(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" \
        and op_name(node) in DEQUANT_OPS


def _is_int8_anchor(node: Node) -> bool:
    """conv/linear with dq input and dq weight, or matmul/bmm of two dq operands."""
    return op_name(node) in ANCHORS and len(node.args) >= 2 \
        and all(_is_dequantized(a) for a in node.args[:2])


def _fuses(node: Node, user: Node) -> bool:
    """``node → user`` is one step of an int8 ``anchor → add → relu/clamp`` chain."""
    name = op_name(user)
    if _is_int8_anchor(node):
        return name in CHAIN_ACTS or name == "add"
    if op_name(node) == "add" and any(isinstance(a, Node) and _is_int8_anchor(a)
                                      for a in node.args):
        return name in CHAIN_ACTS
    return False


def _output_tail(graph: torch.fx.Graph) -> set[Node]:
    """Compute nodes whose float result reaches only the graph output (through other tail
    nodes): the final computation, which may stay float."""
    tail: set[Node] = set()
    for node in reversed(graph.nodes):
        users = [u for u in node.users if u.op == "output" or _is_compute(u)
                 or op_name(u) in QUANT_OPS]  # read in int8 elsewhere: not just the output
        if _is_compute(node) and users and all(u.op == "output" or u in tail for u in users):
            tail.add(node)
    return tail


def _island_reason(node: Node, derived: set[Node]) -> str:
    if node in derived:
        return "input-derived"
    if op_name(node) in ANCHORS and not _is_int8_anchor(node):
        return "float weights" if op_name(node) in ("conv1d", "conv2d", "linear") \
            else "float activation"
    return "float activation"


def _module(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]).removeprefix("L['self'].") if stack else ""


def _location(node: Node) -> str:
    """``path:line: source`` of the innermost frame of the model's code (not torch's)."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = [(i, ln.strip()) for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    ours = [(i, f) for i, f in frames if _TORCH_DIR not in f] or frames
    if not ours:
        return ""
    i, frame = ours[-1]
    match = re.match(r'File "(.+)", line (\d+)', frame)
    where = f"{match.group(1)}:{match.group(2)}" if match else frame
    source = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return f"{where}: {source}" if source and not source.startswith("File ") else where

"""PT2E-converted FX graph → QIR.

Shapes come from running the graph once on example inputs of the batch size asked for (QIR is
static-shaped). Every aten op the quantizers emit for CNNs and transformers maps onto a QIR op;
anything else imports as ``float_op`` with its location (run as is, reported by the
integer-only gate), never dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.fx.operator_schemas import normalize_function
from torch.fx.passes.shape_prop import ShapeProp

from qcompile.errors import UnsupportedGraphError
from qcompile.frontend.quantize import op_name
from qcompile.ir.graph import Graph, Node, Op, node
from qcompile.ir.qmath import int8_dtype
from qcompile.ir.types import DType, QParams

_DTYPES = {torch.float32: DType.F32, torch.uint8: DType.U8, torch.int8: DType.I8,
           torch.int32: DType.I32, torch.int64: DType.I64, torch.bool: DType.BOOL}
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze"})
UNARY = {"relu": Op.RELU, "hardswish": Op.HARDSWISH, "silu": Op.SILU, "gelu": Op.GELU,
         "sigmoid": Op.SIGMOID, "tanh": Op.TANH}
BINARY = {"add": Op.ADD, "sub": Op.SUB, "mul": Op.MUL, "div": Op.DIV}


def location(n: torch.fx.Node) -> str:
    """``file.py:LINE module.path`` of the source line that produced ``n``."""
    module = ""
    stack = n.meta.get("nn_module_stack")
    if stack:
        module = list(stack.values())[-1][0]
    trace = n.meta.get("stack_trace") or ""
    where = ""
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith("File "):
            parts = line.split(",")
            file = os.path.basename(parts[0].split('"')[1]) if '"' in parts[0] else "?"
            lineno = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            where = f"{file}:{lineno}"
            break
    return " ".join(p for p in (where, module, n.name) if p)


class _Importer:
    def __init__(self, gm: torch.fx.GraphModule, name: str,
                 concrete: dict[torch.fx.Node, Any] | None = None) -> None:
        self.gm, self.name = gm, name
        self.values: dict[torch.fx.Node, Any] = {}
        self.concrete = concrete or {}

    def run(self) -> Graph:
        inputs, outputs = [], ()
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.values[n] = node(Op.INPUT, *self._type(n), name=n.name, loc=n.name)
                inputs.append(self.values[n])
            elif n.op == "get_attr":
                self.values[n] = self._const(_fetch(self.gm, n.target), loc=n.target)
            elif n.op == "call_function" and n in self.concrete:
                # ints, asserts and constant index tensors: folded at import
                self.values[n] = self._const(self.concrete[n], loc=location(n))
            elif n.op == "call_function":
                self.values[n] = self._call(n)
            elif n.op == "output":
                outputs = tuple(self._out(a) for a in _flatten(n.args[0]))
        return Graph(self.name, tuple(inputs), outputs)

    def _out(self, a: Any) -> Node:
        v = self.values.get(a)
        if not isinstance(v, Node):
            raise UnsupportedGraphError(f"graph output {a} is not a tensor", at=str(a),
                                        why="qcompile graphs return tensors only",
                                        next="return tensors (or a tuple of tensors)")
        return v

    def _type(self, n: torch.fx.Node) -> tuple[DType, tuple[int, ...]]:
        meta = n.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise UnsupportedGraphError(
                f"op {n.target} does not produce one tensor", at=location(n),
                why="multi-output ops are not part of QIR",
                next="report this model; the op needs an importer rule")
        if meta.dtype not in _DTYPES:
            raise UnsupportedGraphError(f"dtype {meta.dtype} is not supported", at=location(n),
                                        why="QIR has f32, i8, u8, i32, i64 and bool values",
                                        next="cast the tensor to float32 in the model")
        return _DTYPES[meta.dtype], tuple(int(d) for d in meta.shape)

    def _const(self, value: Any, loc: str | None = None) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        arr = value.detach().contiguous().numpy()
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        return node(Op.CONST, DType.of_numpy(arr.dtype), arr.shape, value=arr, loc=loc)

    def _args(self, n: torch.fx.Node) -> dict[str, Any]:
        return {k: self._value(v) for k, v in bind_schema(n).items()}

    def _value(self, v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return self.values[v]
        if isinstance(v, list | tuple):
            return type(v)(self._value(x) for x in v)
        return v

    def _call(self, n: torch.fx.Node) -> Node:
        name = op_name(n)
        handler = _HANDLERS.get(name)
        dtype, shape = self._type(n)
        loc = location(n)
        if handler is not None:
            result = handler(self, name, self._args(n), dtype, shape, loc)
            if result is not None:
                return result
        return self._float_op(n, dtype, shape, loc)

    def _float_op(self, n: torch.fx.Node, dtype: DType, shape: tuple[int, ...],
                  loc: str) -> Node:
        src: list[Node] = []

        def template(v: Any) -> Any:
            if isinstance(v, torch.fx.Node):
                if not isinstance(self.values[v], Node):
                    return self.values[v]          # a folded integer
                src.append(self.values[v])
                return ("%", len(src) - 1)
            if isinstance(v, list | tuple):
                return tuple(template(x) for x in v)
            if isinstance(v, torch.device):
                return ("device", str(v))
            if isinstance(v, torch.dtype | torch.memory_format | torch.layout):
                return ("torch", str(v).removeprefix("torch."))
            return v

        args = template(tuple(n.args))
        kwargs = tuple((k, template(v)) for k, v in n.kwargs.items())
        return node(Op.FLOAT_OP, dtype, shape, *src, target=str(n.target), args=args,
                    kwargs=kwargs, loc=loc)

    def _tensor(self, v: Any) -> Node:
        if isinstance(v, Node):
            return v
        arr = np.asarray(v, dtype=np.float32)
        return node(Op.CONST, DType.F32, arr.shape, value=arr)


def bind_schema(n: torch.fx.Node) -> dict[str, Any]:
    """Arguments of an aten call by schema name, defaults filled in."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        pair = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
        return dict(pair.kwargs) if pair is not None else dict(n.kwargs)
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(n.args):
            bound[arg.name] = n.args[i]
        elif arg.name in n.kwargs:
            bound[arg.name] = n.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, list | tuple):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _scalars(v: Any) -> tuple[Any, ...]:
    if isinstance(v, Node):
        return tuple(np.asarray(v.attrs.value).reshape(-1).tolist())
    if isinstance(v, torch.Tensor):
        return tuple(v.reshape(-1).tolist())
    return (v,)


def _qparams(a: dict[str, Any], axis: int | None = None) -> QParams:
    dtype = int8_dtype(str(a["dtype"]).removeprefix("torch."))
    scale = tuple(float(s) for s in _scalars(a["scale" if "scale" in a else "scales"]))
    zp = tuple(int(z) for z in _scalars(a["zero_point" if "zero_point" in a else "zero_points"]))
    return QParams(dtype, scale, zp, int(a["quant_min"]), int(a["quant_max"]), axis)


Handler = Callable[[_Importer, str, dict[str, Any], DType, tuple[int, ...], str], Node | None]
_HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def add(fn: Handler) -> Handler:
        for name in names:
            _HANDLERS[name] = fn
        return fn

    return add


@handles("quantize_per_tensor", "quantize_per_tensor_tensor")
def _quantize(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.QUANT, dt, shape, a["input"], qp=_qparams(a), loc=loc)


@handles("dequantize_per_tensor", "dequantize_per_tensor_tensor")
def _dequantize(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.DEQUANT, dt, shape, a["input"], qp=_qparams(a), loc=loc)


@handles("quantize_per_channel")
def _quantize_pc(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.QUANT, dt, shape, a["input"], qp=_qparams(a, int(a["axis"])), loc=loc)


@handles("dequantize_per_channel")
def _dequantize_pc(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.DEQUANT, dt, shape, a["input"], qp=_qparams(a, int(a["axis"])), loc=loc)


@handles("conv2d", "conv1d")
def _conv(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    x, w, b = a["input"], a["weight"], a.get("bias")
    padding = a.get("padding", 0)
    if isinstance(padding, str):
        return None  # 'same'/'valid' padding strings: run as a float op
    rank = len(x.shape) - 2
    attrs = dict(stride=_pair(a.get("stride", 1)), padding=_pair(padding),
                 dilation=_pair(a.get("dilation", 1)), groups=int(a.get("groups", 1)))
    if rank == 1:
        return _conv1d_as_2d(x, w, b, attrs, dt, shape, loc)
    return node(Op.CONV2D, dt, shape, *([x, w] + ([b] if b is not None else [])), loc=loc,
                **attrs)


def _conv1d_as_2d(x: Node, w: Node, b: Node | None, attrs: dict, dt: DType,
                  shape: tuple, loc: str) -> Node:
    """conv1d(N,C,L) as conv2d on (N,C,1,L): reshape the input, and the weight constant itself
    (so the weight stays ``dequant(const)`` for the fusion passes)."""
    x4 = node(Op.RESHAPE, x.dtype, (*x.shape[:2], 1, x.shape[2]), x, loc=loc,
              shape=(*x.shape[:2], 1, x.shape[2]))
    w4 = _unsqueeze_weight(w)
    attrs = {**attrs, "stride": (1, attrs["stride"][0]), "padding": (0, attrs["padding"][0]),
             "dilation": (1, attrs["dilation"][0])}
    out4 = (*shape[:2], 1, shape[2])
    conv = node(Op.CONV2D, dt, out4, *([x4, w4] + ([b] if b is not None else [])), loc=loc,
                **attrs)
    return node(Op.RESHAPE, dt, shape, conv, loc=loc, shape=shape)


def _unsqueeze_weight(w: Node) -> Node:
    if w.op is Op.CONST:
        v = w.attrs.value[:, :, None, :]
        return w.with_(shape=v.shape, attrs=w.attrs.replace(value=v))
    if w.op is Op.DEQUANT and w.src[0].op is Op.CONST:
        c = _unsqueeze_weight(w.src[0])
        return w.with_(shape=c.shape, src=(c,))
    shape = (*w.shape[:2], 1, w.shape[2])
    return node(Op.RESHAPE, w.dtype, shape, w, shape=shape, loc=w.loc)


@handles("linear")
def _linear(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    src = [a["input"], a["weight"]] + ([a["bias"]] if a.get("bias") is not None else [])
    return node(Op.LINEAR, dt, shape, *src, loc=loc)


@handles("matmul", "bmm")
def _matmul(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.MATMUL, dt, shape, a["self"], a["other" if "other" in a else "mat2"], loc=loc)


@handles(*BINARY)
def _binary(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    if a.get("alpha", 1) != 1 or "rounding_mode" in a and a["rounding_mode"] is not None:
        return None
    lhs, rhs = im._tensor(a["self"]), im._tensor(a["other"])
    return node(BINARY[name], dt, shape, lhs, rhs, loc=loc)


@handles(*UNARY)
def _unary(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    op = UNARY[name]
    extra = {"approximate": a.get("approximate", "none")} if op is Op.GELU else {}
    return node(op, dt, shape, a["self"], loc=loc, **extra)


@handles("relu6", "hardtanh", "clamp")
def _clamp(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    lo = 0.0 if name == "relu6" else a.get("min_val", a.get("min"))
    hi = 6.0 if name == "relu6" else a.get("max_val", a.get("max"))
    if isinstance(lo, Node) or isinstance(hi, Node):
        return None
    return node(Op.CLAMP, dt, shape, a["self"], loc=loc,
                lo=None if lo is None else float(lo), hi=None if hi is None else float(hi))


def _pair(v: Any) -> tuple[int, int]:
    v = tuple(v) if isinstance(v, list | tuple) else (v,)
    return (int(v[0]), int(v[-1])) if v else (0, 0)


@handles("max_pool2d")
def _maxpool(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    if a.get("ceil_mode"):
        return None
    kernel = _pair(a["kernel_size"])
    stride = _pair(a.get("stride") or kernel)
    return node(Op.MAXPOOL2D, dt, shape, a["self"], loc=loc, kernel=kernel, stride=stride,
                padding=_pair(a.get("padding", 0)), dilation=_pair(a.get("dilation", 1)))


@handles("avg_pool2d")
def _avgpool(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    kernel = _pair(a["kernel_size"])
    padding = _pair(a.get("padding", 0))
    if a.get("ceil_mode") or (padding != (0, 0) and not a.get("count_include_pad", True)):
        return None  # windows with varying divisors: run as a float op
    divisor = a.get("divisor_override") or kernel[0] * kernel[1]
    return node(Op.AVGPOOL2D, dt, shape, a["self"], loc=loc, kernel=kernel,
                stride=_pair(a.get("stride") or kernel), padding=padding, divisor=int(divisor))


@handles("adaptive_avg_pool2d")
def _adaptive_avg(im: _Importer, name: str, a: dict, dt: DType, shape: tuple,
                  loc: str) -> Node | None:
    x = a["self"]
    h, w = x.shape[-2:]
    oh, ow = shape[-2:]
    if (oh, ow) == (1, 1):
        return node(Op.MEAN, dt, shape, x, loc=loc, dims=(len(x.shape) - 2, len(x.shape) - 1),
                    keepdim=True)
    if h % oh or w % ow:
        return None
    k = (h // oh, w // ow)
    return node(Op.AVGPOOL2D, dt, shape, x, loc=loc, kernel=k, stride=k, padding=(0, 0),
                divisor=k[0] * k[1])


@handles("mean")
def _mean(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    dims = a.get("dim")
    if dims is None or a.get("dtype") is not None:
        return None
    rank = len(a["self"].shape)
    dims = tuple(sorted(d % rank for d in (dims if isinstance(dims, list | tuple) else [dims])))
    return node(Op.MEAN, dt, shape, a["self"], loc=loc, dims=dims,
                keepdim=bool(a.get("keepdim", False)))


@handles(*RESHAPES)
def _reshape(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.RESHAPE, dt, shape, a["self" if "self" in a else "input"], loc=loc,
                shape=shape)


@handles("permute", "transpose", "t")
def _permute(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    x = a["self"]
    rank = len(x.shape)
    if "dims" in a:
        dims = tuple(d % rank for d in a["dims"])
    else:
        d0, d1 = (a.get("dim0", 0) % rank, a.get("dim1", 1) % rank) if rank else (0, 0)
        order = list(range(rank))
        order[d0], order[d1] = order[d1], order[d0]
        dims = tuple(order)
    return node(Op.PERMUTE, dt, shape, x, loc=loc, dims=dims)


@handles("cat", "concat")
def _cat(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    parts = [im._tensor(t) for t in a["tensors"]]
    return node(Op.CAT, dt, shape, *parts, loc=loc, axis=int(a.get("dim", 0)) % len(shape))


@handles("pad", "constant_pad_nd")
def _pad(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node | None:
    if a.get("mode", "constant") != "constant":
        return None
    value = a.get("value")
    return node(Op.PAD, dt, shape, a["input" if "input" in a else "self"], loc=loc,
                pads=tuple(int(p) for p in a["pad"]), value=float(value or 0.0))


@handles("softmax", "_softmax")
def _softmax(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.SOFTMAX, dt, shape, a["self"], loc=loc, axis=int(a["dim"]) % len(shape))


@handles("layer_norm")
def _layer_norm(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    norm = tuple(int(d) for d in a["normalized_shape"])
    w, b = a.get("weight"), a.get("bias")
    affine = w is not None or b is not None
    src = [a["input"]]
    if affine:      # a weight without a bias (LayerNorm(bias=False)) or the reverse: fill in
        src += [im._tensor(np.ones(norm, np.float32)) if w is None else w,
                im._tensor(np.zeros(norm, np.float32)) if b is None else b]
    return node(Op.LAYER_NORM, dt, shape, *src, loc=loc, normalized_shape=norm,
                eps=float(a.get("eps", 1e-5)), affine=affine)


@handles("embedding")
def _embedding(im: _Importer, name: str, a: dict, dt: DType, shape: tuple, loc: str) -> Node:
    return node(Op.EMBEDDING, dt, shape, a["weight"], a["indices"], loc=loc)


def import_graph(gm: torch.fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 name: str = "model") -> Graph:
    """QIR for ``gm`` specialised to the shapes of ``example_inputs``."""
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
        concrete = _concrete_values(gm, example_inputs)
    return _Importer(gm, name, concrete).run()


_INDEX_DTYPES = (torch.int64, torch.int32, torch.bool)


def _concrete_values(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]
                     ) -> dict[torch.fx.Node, Any]:
    """Non-tensor results (``sym_size`` and the integer arithmetic of a dynamic-batch export),
    which a static-shaped QIR folds to constants; and integer tensors computed from constant
    tensors and those alone (position ids sliced to the length of a dynamic-length export:
    ``convert_pt2e`` folds them itself when the length is static)."""
    found: dict[torch.fx.Node, Any] = {}

    def from_constants(n: torch.fx.Node, out: Any) -> bool:
        ins = n.all_input_nodes
        return isinstance(out, torch.Tensor) and out.dtype in _INDEX_DTYPES and any(
            a.op == "get_attr" for a in ins) and all(a.op == "get_attr" or a in found
                                                     for a in ins)

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.op == "call_function" and (not isinstance(out, torch.Tensor)
                                            or from_constants(n, out)):
                found[n] = out
            return out

    Recorder(gm).run(*inputs)
    return found

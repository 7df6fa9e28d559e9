"""QIR after the pass pipeline → one ONNX model (opset 17), integer chains in integer ONNX ops.

The integer semantics are those of :mod:`qcompile.ir.qmath`, spelled in ONNX ops whose ONNX
Runtime CPU kernels are exact:

* contractions: ``ConvInteger`` / ``MatMulInteger`` on the int8 operands and their zero points
  (i32 accumulators; ``ConvInteger`` pads with the input zero point, which is exactly the
  reference's zero padding of ``x - zp``), then the i32 bias as an ``Add``;
* requantize: every term ``(x - z) * M[c]`` in int64, plus ``2^(s-1)``; the arithmetic right
  shift by ``s`` is a floor division, ``(v - Mod(v, 2^s)) / 2^s`` (``Mod`` with ``fmod=0`` takes
  the divisor's sign, so the subtraction makes the truncating ``Div`` exact); then the zero point,
  the clamp and a ``Cast`` to int8/uint8;
* window sums (``QSUMPOOL2D``): a depthwise ``ConvInteger`` with all-one weights; ``QSUM``:
  ``ReduceSum`` of ``x - zp`` in int32; ``LUT``: ``Gather`` of the 256-entry table;
* PT2E's quantize: ``Mul`` by the float32 reciprocal, ``Round`` (half to even), ``+ zp``,
  ``Clip``, ``Cast``; dequantize: ``(x - zp)`` as float32 times the scale.

NHWC nodes (the channels-last pass) are wrapped in ``Transpose``s: ONNX convolutions and pools
are NCHW, and ONNX Runtime's transpose optimizer cancels the pairs between them. Float fallback
ops map onto their ONNX counterparts; an op with no mapping is an ``UnsupportedGraphError``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcompile.errors import UnsupportedGraphError
from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType

OPSET = 17
ONNX_DTYPE = {DType.F32: TensorProto.FLOAT, DType.I8: TensorProto.INT8,
              DType.U8: TensorProto.UINT8, DType.I32: TensorProto.INT32,
              DType.I64: TensorProto.INT64, DType.BOOL: TensorProto.BOOL}
TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]

Lowering = Callable[["Exporter", Node, list[str]], str]
_LOWERINGS: dict[Op, Lowering] = {}


def lowers(*ops: Op) -> Callable[[Lowering], Lowering]:
    def add(fn: Lowering) -> Lowering:
        for op in ops:
            _LOWERINGS[op] = fn
        return fn

    return add


class Exporter:
    """Builds one ONNX graph: ``op`` adds a node and returns its output name, ``const`` adds an
    initializer. Names are ``v<N>`` in emission order; node names carry the QIR location."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0
        self.loc = ""

    def fresh(self, hint: str = "v") -> str:
        self._n += 1
        return f"{hint}{self._n}"

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        out = self.fresh()
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out} {self.loc}",
                                           **attrs))
        return out

    def const(self, value: np.ndarray | int | float, dtype: np.dtype | type | None = None
              ) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def cast(self, x: str, dtype: DType) -> str:
        return self.op("Cast", [x], to=ONNX_DTYPE[dtype])


def export(graph: Graph) -> onnx.ModelProto:
    """The ONNX model of ``graph``: same inputs (by position, named ``input_<i>``), same
    outputs (``output_<i>``), same dtypes and static shapes."""
    ex = Exporter(graph.name)
    names: dict[int, str] = {}
    inputs = []
    for i, n in enumerate(graph.inputs):
        names[id(n)] = f"input_{i}"
        inputs.append(helper.make_tensor_value_info(names[id(n)], ONNX_DTYPE[n.dtype],
                                                    list(n.shape)))
    for n in graph.nodes():
        if id(n) in names:
            continue
        ex.loc = n.loc or n.op.value
        if n.op is Op.CONST:
            names[id(n)] = ex.const(n.attrs.value)
            continue
        lowering = _LOWERINGS.get(n.op)
        if lowering is None:
            raise _unsupported(n)
        names[id(n)] = lowering(ex, n, [names[id(s)] for s in n.src])
    outputs = []
    for i, o in enumerate(graph.outputs):
        name = f"output_{i}"
        ex.nodes.append(helper.make_node("Identity", [names[id(o)]], [name]))
        outputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[o.dtype], list(o.shape)))
    used = {name for n in ex.nodes for name in n.input}
    inits = [t for t in ex.inits if t.name in used]   # weights re-laid by their lowering
    g = helper.make_graph(ex.nodes, graph.name, inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="qcompile")
    model.ir_version = 8
    return model


def _unsupported(n: Node) -> UnsupportedGraphError:
    what = n.attrs.get("target", n.op.value)
    return UnsupportedGraphError(
        f"ort: no ONNX lowering for {what!r}", at=n.loc or n.op.value,
        why=f"the ort exporter maps QIR ops {', '.join(sorted(o.value for o in _LOWERINGS))}",
        next="run this model on target cpu or reference, or add a lowering in "
             "qcompile/codegen/ort/export.py")


def nchw(ex: Exporter, n: Node, x: str) -> str:
    return ex.op("Transpose", [x], perm=TO_NCHW) if n.attrs.get("layout") == "nhwc" else x


def back(ex: Exporter, n: Node, y: str) -> str:
    return ex.op("Transpose", [y], perm=TO_NHWC) if n.attrs.get("layout") == "nhwc" else y


def zero_point(ex: Exporter, zp: int, dtype: DType) -> str:
    return ex.const(zp, dtype.np)


def conv_attrs(n: Node) -> dict[str, object]:
    a = n.attrs
    return {"strides": list(a.stride), "pads": [*a.padding, *a.padding],
            "dilations": list(a.dilation), "group": int(a.groups)}


from qcompile.codegen.ort import lower_float, lower_int  # noqa: E402,F401  (register lowerings)

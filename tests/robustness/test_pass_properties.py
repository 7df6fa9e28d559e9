"""Pass-pipeline properties on random Q/DQ graphs, generated directly as QIR in the importer's
form (so hundreds of examples fit the time budget): chains of conv / linear / add / relu /
maxpool / avgpool / cat with random shapes, scales and zero points.

* agreement: after ``run_pipeline`` every int8 tensor, recomputed by the reference interpreter
  from the PT2E-style reference codes of its inputs, is within one quantization step of the
  reference code (the reference: the same Q/DQ graph evaluated with torch's own
  ``quantized_decomposed`` quantize/dequantize and float ops, as PT2E's converted model runs);
* the verifier accepts every stage (``run_pipeline`` verifies after each pass; graphs with float
  islands and ops without int8 lowering are generated too);
* the integer-only gate never lets a float op through silently: every float op left carries a
  ``fallback`` reason, and the ``error`` policy raises exactly when one is inside the int8 region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import robustness_tally as tally
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given
from hypothesis import strategies as st

import calibration.methods  # noqa: F401 - imports torchao: torch.ops.quantized_decomposed
from qcompile.errors import UnsupportedGraphError
from qcompile.ir.graph import Graph, Node, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.ir.verify import VerifyError
from qcompile.passes.channels_last import TO_NHWC, is_layout_change, nhwc_values
from qcompile.passes.check_integer_only import BOUNDARY
from qcompile.passes.pipeline import default_pipeline, run_pipeline
from qcompile.reference import interpreter

QD = torch.ops.quantized_decomposed
F32 = DType.F32


class Choices:
    """Hypothesis draws, or (``draw`` None) the first option of each: a fixed graph."""

    def __init__(self, draw: Any = None, flag: bool = False) -> None:
        self.draw, self._flag = draw, flag

    def pick(self, options: list[Any]) -> Any:
        return self.draw(st.sampled_from(options)) if self.draw else options[0]

    def flag(self) -> bool:
        return bool(self.draw(st.booleans())) if self.draw else self._flag

    def integer(self, lo: int, hi: int) -> int:
        return int(self.draw(st.integers(lo, hi))) if self.draw else hi


@dataclass
class Builder:
    """Builds an import-style Q/DQ graph and evaluates it eagerly, PT2E style, as it goes."""

    rng: np.random.Generator
    choose: Choices
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    codes: dict[str, np.ndarray] = field(default_factory=dict)   # quant name -> reference code
    count: int = 0

    def _name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def add(self, n: Node, value: torch.Tensor) -> Node:
        assert tuple(value.shape) == n.shape, (n.op, value.shape, n.shape)
        self.values[id(n)] = value
        return n

    def v(self, n: Node) -> torch.Tensor:
        return self.values[id(n)]

    def input(self, shape: tuple[int, ...]) -> Node:
        x = node(Op.INPUT, F32, shape, name="x", loc="x")
        return self.add(x, torch.from_numpy(self.rng.standard_normal(shape).astype(np.float32)
                                            * float(self.choose.pick([1.0, 0.1, 5.0]))))

    def qparams(self, f: Node, *, like: QParams | None = None) -> QParams:
        """Calibrated on the value seen, then perturbed (a bad calibration is a valid input)."""
        if like is not None and not self.choose.flag():
            return like                          # shared qparams, as the quantizer sets them
        x = self.v(f)
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        factor = self.choose.pick([1.0, 0.25, 0.5, 1.0, 1.0, 2.0])
        if self.choose.flag():                  # int8 symmetric
            s = max(max(-lo, hi) / 127.5 * factor, 2**-12)
            return QParams(DType.I8, (s,), (0,), -128, 127)
        s = max((hi - lo) / 255 * factor, 2**-12)
        zp = int(np.clip(round(-lo / s), 0, 255))
        return QParams(DType.U8, (s,), (zp,), 0, 255)

    def quant(self, f: Node, qp: QParams) -> Node:
        name = self._name("quantize_per_tensor")
        q = node(Op.QUANT, qp.dtype, f.shape, f, qp=qp, loc=f"gen.py:1 {name}")
        code = QD.quantize_per_tensor.default(self.v(f), qp.s, qp.zp, qp.qmin, qp.qmax,
                                              torch.uint8 if qp.dtype is DType.U8
                                              else torch.int8)
        self.codes[name] = code.numpy()
        if f.op is Op.CAT or (f.op in (Op.MAXPOOL2D, Op.RESHAPE) and f.src[0].attrs.qp == qp):
            # int8 data movement keeps the op's location on a node of this grid: that node
            # stands for this quantize too (a cat's parts are rescaled onto its grid)
            self.codes[f.loc.split()[-1]] = code.numpy()
        return self.add(q, code)

    def dq(self, q: Node) -> Node:
        qp = q.attrs.qp
        d = node(Op.DEQUANT, F32, q.shape, q, qp=qp, loc=f"gen.py:1 {self._name('dequantize')}")
        return self.add(d, QD.dequantize_per_tensor.default(
            self.v(q), qp.s, qp.zp, qp.qmin, qp.qmax, self.v(q).dtype))

    def op(self, op: Op, dims: tuple[int, ...], *src: Node, value: torch.Tensor,
           **attrs: Any) -> Node:
        return self.add(node(op, F32, dims, *src, loc=f"gen.py:1 {self._name(op.value)}",
                             **attrs), value)

    def weight(self, shape: tuple[int, ...], fan_in: int) -> Node:
        codes = self.rng.integers(-127, 128, size=shape).astype(np.int8)
        scales = tuple(float(s) for s in self.rng.uniform(0.5, 2.0, shape[0])
                       / (127 * np.sqrt(fan_in)))
        w = self.add(node(Op.CONST, DType.I8, shape, value=codes), torch.from_numpy(codes))
        qp = QParams(DType.I8, scales, (0,) * shape[0], -127, 127, axis=0)
        d = node(Op.DEQUANT, F32, shape, w, qp=qp, loc=f"gen.py:1 {self._name('dq_weight')}")
        return self.add(d, QD.dequantize_per_channel.default(
            torch.from_numpy(codes), torch.tensor(scales, dtype=torch.float64),
            torch.zeros(shape[0], dtype=torch.int64), 0, -127, 127, torch.int8))

    def bias(self, c: int) -> Node:
        b = (self.rng.standard_normal(c) * 0.1).astype(np.float32)
        return self.add(node(Op.CONST, F32, (c,), value=b), torch.from_numpy(b))

    # ---------------------------------------------------------------- layers (float results)
    def conv(self, x: Node, cout: int, k: int, stride: int, pad: int, groups: int = 1) -> Node:
        n, cin, h, w = x.shape
        weight, bias = self.weight((cout, cin // groups, k, k), cin // groups * k * k), \
            self.bias(cout)
        value = F.conv2d(self.v(x), self.v(weight), self.v(bias), stride, pad, 1, groups)
        return self.op(Op.CONV2D, tuple(value.shape), x, weight, bias, value=value,
                       stride=(stride, stride), padding=(pad, pad), dilation=(1, 1),
                       groups=groups)

    def act(self, f: Node, kind: str) -> Node:
        if kind == "relu":
            return self.op(Op.RELU, f.shape, f, value=torch.relu(self.v(f)))
        if kind == "relu6":
            return self.op(Op.CLAMP, f.shape, f, value=torch.clamp(self.v(f), 0.0, 6.0), lo=0.0,
                           hi=6.0)
        return f


def _spatial_ok(x: Node, k: int, stride: int, pad: int) -> bool:
    return (x.shape[2] + 2 * pad - k) // stride + 1 >= 1 and (x.shape[3] + 2 * pad - k) // \
        stride + 1 >= 1 and pad <= k // 2


LAYERS = ["conv", "conv", "depthwise", "residual", "add", "maxpool", "avgpool", "cat", "relu",
          "island", "unsupported"]


def layer(b: Builder, q: Node, kind: str, islands: bool) -> Node:
    """One layer on the quantized tensor ``q``; returns the quantized result."""
    c_ = b.choose
    act = c_.pick(["none", "relu", "relu6"])
    n, c, h, w = q.shape
    if kind in ("conv", "depthwise"):
        k, stride = c_.pick([3, 1]), c_.pick([1, 1, 2])
        pad = c_.pick([k // 2, 0])
        if not _spatial_ok(q, k, stride, pad):
            k, stride, pad = 1, 1, 0
        cout = c if kind == "depthwise" else c_.integer(1, 8)
        f = b.act(b.conv(b.dq(q), cout, k, stride, pad, c if kind == "depthwise" else 1), act)
        return b.quant(f, b.qparams(f))
    if kind == "residual":                       # conv(q) + q: the conv epilogue takes it
        f = b.conv(b.dq(q), c, 3 if h > 2 and w > 2 else 1, 1, 1 if h > 2 and w > 2 else 0)
        s = b.act(b.op(Op.ADD, q.shape, f, r := b.dq(q), value=b.v(f) + b.v(r)), act)
        return b.quant(s, b.qparams(s))
    if kind == "add":                           # q + a quantized branch: an int8 add
        branch = layer(b, q, "conv", False) if q.shape[1] else q
        if branch.shape != q.shape:
            branch = q
        x, y = b.dq(q), b.dq(branch)
        s = b.act(b.op(Op.ADD, q.shape, x, y, value=b.v(x) + b.v(y)), act)
        return b.quant(s, b.qparams(s))
    if kind in ("maxpool", "avgpool"):
        k, stride = c_.pick([(2, 2), (3, 1), (3, 2), (h, w)][:3 if h != w else 4])
        if isinstance(k, int):
            k, stride = (k, k), (stride, stride)
        if h < k[0] or w < k[1]:
            return q
        x = b.dq(q)
        if kind == "maxpool":
            value = F.max_pool2d(b.v(x), k, stride)
            f = b.op(Op.MAXPOOL2D, tuple(value.shape), x, value=value, kernel=k, stride=stride,
                     padding=(0, 0), dilation=(1, 1))
            return b.quant(f, b.qparams(f, like=q.attrs.qp))
        value = F.avg_pool2d(b.v(x), k, stride)
        f = b.op(Op.AVGPOOL2D, tuple(value.shape), x, value=value, kernel=k, stride=stride,
                 padding=(0, 0), divisor=k[0] * k[1])
        return b.quant(f, b.qparams(f))
    if kind == "cat":
        other = layer(b, q, "conv", False)
        if other.shape[2:] != q.shape[2:]:
            return other
        x, y = b.dq(q), b.dq(other)
        value = torch.cat([b.v(x), b.v(y)], 1)
        f = b.op(Op.CAT, tuple(value.shape), x, y, value=value, axis=1)
        return b.quant(f, b.qparams(f, like=q.attrs.qp))
    if kind == "relu":
        x = b.dq(q)
        f = b.act(x, "relu6" if act == "relu6" else "relu")
        return b.quant(f, b.qparams(f, like=q.attrs.qp))
    if kind == "island" and islands:            # a float op no quantize covers, mid-chain
        x = b.dq(q)
        f = b.op(Op.SIGMOID, q.shape, x, value=torch.sigmoid(b.v(x)))
        g = b.act(b.conv(f, c_.integer(1, 6), 1, 1, 0), act)   # reads float directly
        return b.quant(g, b.qparams(g))
    if kind == "unsupported" and islands:       # softmax has no int8 lowering
        x = b.dq(q)
        f = b.op(Op.SOFTMAX, q.shape, x, value=torch.softmax(b.v(x), -1), axis=3)
        return b.quant(f, b.qparams(f))
    return q


@st.composite
def graphs(draw, islands: bool = False):  # type: ignore[no-untyped-def]
    b = Builder(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), Choices(draw))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 8)),
             draw(st.integers(1, 8)))
    x = b.input(shape)
    q = b.quant(x, b.qparams(x))
    for kind in draw(st.lists(st.sampled_from(LAYERS if islands else LAYERS[:-2]), min_size=1,
                              max_size=5)):
        q = layer(b, q, kind, islands)
    if draw(st.booleans()):                 # classifier head: flatten, linear, float logits
        d = b.dq(q)
        flat = b.op(Op.RESHAPE, (q.shape[0], int(np.prod(q.shape[1:]))), d,
                    value=b.v(d).reshape(q.shape[0], -1),
                    shape=(q.shape[0], int(np.prod(q.shape[1:]))))
        fq = b.quant(flat, q.attrs.qp)
        d2 = b.dq(fq)
        out_features = draw(st.integers(1, 6))
        w, bias = b.weight((out_features, flat.shape[1]), flat.shape[1]), b.bias(out_features)
        value = F.linear(b.v(d2), b.v(w), b.v(bias))
        out = b.op(Op.LINEAR, tuple(value.shape), d2, w, bias, value=value)
        if draw(st.booleans()):             # a quantized linear (+ relu) inside the chain
            f = b.act(out, draw(st.sampled_from(["none", "relu"])))
            out = b.dq(b.quant(f, b.qparams(f)))
    else:
        out = b.dq(q)
    return Graph("gen", (x,), (out,)), b


# ---------------------------------------------------------------------------------- checks
def _fx_name(n: Node) -> str:
    return (n.loc or "").split()[-1]


def per_layer_steps(graph: Graph, codes: dict[str, np.ndarray], x: np.ndarray
                    ) -> list[tuple[str, int]]:
    """(quant name, max |step| difference) for every int8 node of the lowered graph that
    stands for a reference quantize, recomputed from the reference codes of its inputs."""
    nhwc = nhwc_values(graph)

    def code_of(n: Node) -> np.ndarray | None:
        if not n.dtype.is_int8 or is_layout_change(n) or n.op in (Op.CONST, Op.INPUT):
            return None
        want = codes.get(_fx_name(n))
        if want is not None and id(n) in nhwc and want.ndim == 4:
            return np.ascontiguousarray(np.transpose(want, TO_NHWC))
        return want

    memo: dict[int, np.ndarray] = {}

    def value(n: Node) -> np.ndarray:
        if n.op is Op.INPUT:
            return x
        if n.op is Op.CONST:
            return n.attrs.value
        if (code := code_of(n)) is not None and code.shape == n.shape:
            return code
        if id(n) not in memo:
            memo[id(n)] = interpreter.execute(n, [value(s) for s in n.src])
        return memo[id(n)]

    out = []
    for n in graph.nodes():
        want = code_of(n)
        if want is None or n.op is Op.QUANT:
            continue
        got = interpreter.execute(n, [value(s) for s in n.src])
        if got.shape != want.shape:   # a cat's parts carry the cat's quantize location
            continue
        out.append((_fx_name(n), int(np.abs(got.astype(np.int64) - want.astype(np.int64)).max(
            initial=0))))
    return out


def _inputs_of(b: Builder, g: Graph) -> np.ndarray:
    return b.v(g.inputs[0]).numpy()


@tally.fuzz_settings()
@given(case=graphs())
def test_pipeline__int8_tensors_within_one_step_of_the_pt2e_reference(case):
    g, b = case
    tally.example("passes: within one step per layer")
    x = _inputs_of(b, g)
    try:
        lowered = run_pipeline(g).graph
        steps = per_layer_steps(lowered, b.codes, x)
    except BaseException as err:
        tally.record_unexpected(err, "pipeline agreement")
        raise
    tally.count("passes: int8 tensors compared", len(steps))
    worst = max(steps, key=lambda s: s[1], default=("-", 0))
    assert worst[1] <= 1, f"{worst[0]} differs by {worst[1]} steps"
    # the whole graph runs, on its own, to finite outputs of the right shape
    got = interpreter.run(lowered, x)[0]
    assert got.shape == g.outputs[0].shape and np.isfinite(got).all()


@tally.fuzz_settings()
@given(case=graphs(islands=True))
def test_pipeline__verifier_accepts_every_stage_and_no_float_op_passes_silently(case):
    g, b = case
    tally.example("passes: verifier and integer-only gate")
    try:
        lowered = run_pipeline(g).graph         # verifies after every pass
    except VerifyError as err:
        tally.record_unexpected(err, "verifier")
        raise
    silent = [n for n in lowered.nodes() if n.dtype.is_float and n.op not in BOUNDARY
              and "fallback" not in n.attrs]
    assert silent == [], [(n.op, n.loc) for n in silent]
    inside = [n for n in lowered.nodes() if n.attrs.get("region") == "inside"]
    tally.count("passes: float fallbacks inside the int8 region", len(inside))
    try:
        run_pipeline(g, default_pipeline("error"))
    except UnsupportedGraphError as err:
        assert inside, f"error policy raised with no float op inside the region: {err}"
    else:
        assert not inside, [(n.op, n.loc) for n in inside]
    got = interpreter.run(lowered, _inputs_of(b, g))[0]
    assert got.shape == g.outputs[0].shape


@pytest.mark.parametrize("flag", [False, True], ids=["u8-shared-qparams", "i8-own-qparams"])
@pytest.mark.parametrize("kind", ["conv", "depthwise", "residual", "add", "maxpool",
                                  "avgpool", "cat", "relu"])
def test_each_layer_kind_lowers_to_integer_ops(kind, flag):
    """Not vacuous: each layer kind on its own (fixed choices) leaves no float op, and its
    output is within one step of the reference, end to end (the input quantize is exact)."""
    b = Builder(np.random.default_rng(0), Choices(flag=flag))
    x = b.input((1, 4, 6, 6))
    q = layer(b, b.quant(x, b.qparams(x)), kind, False)
    g = Graph("one", (x,), (b.dq(q),))
    lowered = run_pipeline(g).graph
    floats = [n.op for n in lowered.nodes() if n.dtype.is_float and n.op not in BOUNDARY]
    assert floats == [], floats
    steps = per_layer_steps(lowered, b.codes, _inputs_of(b, g))
    assert max((d for _, d in steps), default=0) <= 1, steps
    got = interpreter.run(lowered, _inputs_of(b, g))[0]
    want = b.v(g.outputs[0]).numpy()
    assert np.abs(got - want).max() <= q.attrs.qp.s * 1.0001

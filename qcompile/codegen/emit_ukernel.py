r"""Conv chains lowered to the AVX-512 VNNI microkernel (:mod:`qcompile.codegen.ukernel`).

::

    x_i8/u8  W_s8  bias_i32                      x_u8 (padded by zp, C rounded up to 4)
        \     |     /                                 |   W packed  params (bias', M, shift)
        QCONV2D (NHWC, groups 1) -> i32                |  /         /
              |            [res_i8/u8]     ==>    flow.dispatch @qk_conv_<conv>_<rq>  -> int8
        REQUANT (per-channel M, shift, clamp)         (implicit GEMM + fused requantize)

The conv emitter returns a :class:`~qcompile.codegen.mlir_emit.Pending` for the chains that
:func:`plan` selects, and the requant emitter calls :func:`emit` in its place. In the MLIR
module the dispatch is a ``func.call`` of a private declaration (``@qk_conv_<conv>_<rq>``), so
the module verifies with the bindings; :func:`link` turns each declaration into its
``hal.executable`` (the target string and the object path depend on the iree-compile flags) and
each call into a ``flow.dispatch``. Everything else in the chain (bias with the folded zero
points, per-channel fixed-point multiplier and shift, residual term, clamp) is computed by the
kernel exactly as :func:`qcompile.ir.qmath.requantize`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import func

from qcompile.codegen import builder as b
from qcompile.codegen import ukernel
from qcompile.codegen.builder import TV
from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import DType

if TYPE_CHECKING:
    from qcompile.codegen.mlir_emit import Emitter

PREFIX = "qk_conv_"


@dataclass(frozen=True)
class UkCall:
    """One microkernel dispatch of a module (what :func:`link` needs to write its executable)."""

    name: str
    shape: ukernel.ConvShape
    nparams: int
    nweights: int
    residual: bool
    loc: str | None = None           # the conv's source location


def why_not(conv: Node, users: dict[int, list[Node]]) -> str | None:
    """``None`` when the chain ``conv → requant`` maps onto the microkernel, else the reason."""
    a = conv.attrs
    if a.get("layout") != "nhwc":
        return "NCHW conv"
    if a.groups != 1:
        return "grouped or depthwise conv"
    readers = users.get(id(conv), [])
    if len(readers) != 1:
        return f"i32 accumulator with {len(readers)} readers"
    rq = readers[0]
    if rq.op is not Op.REQUANT:
        return f"epilogue is {rq.op.value}, not a requantize"
    if rq.src[0] is not conv or conv in rq.src[1:]:
        return "accumulator is not the requantize's first term"
    if len(rq.src) > 2:
        return "more than one residual term"
    if len(rq.src) == 2 and (not rq.src[1].dtype.is_int8 or rq.src[1].shape != rq.shape):
        return "residual term is not an int8 tensor of the output's shape"
    r = rq.attrs.rq
    if r.axis not in (None, 3) or not r.out_dtype.is_int8 or min(r.shift) < 1:
        return "requantize is not per output channel onto int8"
    # no shape is excluded: on the 21 measured conv shapes of resnet18/resnet50/mobilenet_v2 the
    # kernel was never slower than the stock lowering (1 thread 1.07-2.7x, 2 threads 1.0-3.5x;
    # qcompile/codegen/ukernel/README.md)
    return None


def plan(graph: Graph, users: dict[int, list[Node]]) -> tuple[dict[int, Node], dict[str, int]]:
    """``id(conv) -> requant`` of the chains to lower, and the count of each reason for the
    convs that keep the stock lowering."""
    chosen: dict[int, Node] = {}
    stock: dict[str, int] = {}
    for n in graph.nodes():
        if n.op is not Op.QCONV2D:
            continue
        why = why_not(n, users)
        if why is None:
            chosen[id(n)] = users[id(n)][0]
        else:
            stock[why] = stock.get(why, 0) + 1
    return chosen, stock


def _flat(x: TV) -> TV:
    return b.reshape(x, (int(np.prod(x.shape)),))


def emit(em: Emitter, rq_node: Node, x: TV, res: TV | None) -> TV:
    """The microkernel dispatch of the chain ``rq_node.src[0] → rq_node`` on input ``x`` (the
    conv's activation) with the residual operand ``res``."""
    from qcompile.codegen.emit_contract import _weights_ohwi, as_u8, folded_bias

    conv = rq_node.src[0]
    a, rq = conv.attrs, rq_node.attrs.rq
    x, zp = as_u8(x, a.x_zp)
    w = _weights_ohwi(conv)
    f, kh, kw, c = w.shape
    nb, h, wd, _ = x.shape
    (ph, pw), (sh, sw), (dh, dw) = a.padding, a.stride, a.dilation
    cp = ukernel.padded_channels(c)
    with em.loc(conv, ".copy"):
        xp = b.pad(x, [0, ph, pw, 0], [0, ph, pw, cp - c], b.ci(zp, 8))
    s = ukernel.ConvShape(nb, h + 2 * ph, wd + 2 * pw, cp, f, kh, kw, sh, sw, dh, dw,
                          rq_node.shape[1], rq_node.shape[2])
    bias = folded_bias(np.asarray(conv.src[2].attrs.value), w, zp, conv) - rq.terms[0].zero_point
    extra: dict[str, Any] = {}
    operands = [_flat(xp), b.constant(ukernel.pack_weights(w), DType.I8)]
    if res is not None:
        extra = dict(m1=np.asarray(rq.terms[1].multiplier, np.int64),
                     res_zp=rq.terms[1].zero_point, res_signed=res.dtype is DType.I8)
    params = ukernel.pack_params(s, bias, np.asarray(rq.terms[0].multiplier, np.int64),
                                 np.asarray(rq.shift), rq.zp_out, rq.qmin, rq.qmax, **extra)
    operands.append(b.constant(params, DType.I64))
    if res is not None:
        operands.append(_flat(res))
    name = f"{PREFIX}{em.ids[id(conv)]}_{em.ids[id(rq_node)]}"
    out = _call(em, name, operands, s.n * s.oh * s.ow * s.f, rq_node.dtype)
    em.uk_calls.append(UkCall(name, s, params.size, operands[1].shape[0], len(operands) == 4,
                              conv.loc))
    return b.reshape(out, rq_node.shape)


def _call(em: Emitter, name: str, operands: Sequence[TV], size: int, dtype: DType) -> TV:
    """``func.call`` of a private declaration ``name`` (replaced by :func:`link`)."""
    out_t = b.tensor_type((size,), dtype)
    assert em.module is not None
    with ir.InsertionPoint(em.module.body):
        func.FuncOp(name, ([o.value.type for o in operands], [out_t]), visibility="private")
    call = func.CallOp([out_t], ir.FlatSymbolRefAttr.get(name), [o.value for o in operands])
    return TV(call.results[0], dtype, (size,))


_DECL = re.compile(rf"^ *func\.func private @({PREFIX}\d+_\d+)\(.*$", re.M)
_CALL = re.compile(rf"\b(?:func\.)?call @({PREFIX}\d+_\d+)\(")


def link(text: str, calls: Sequence[UkCall], obj: Path, target: str) -> str:
    """``text`` with each microkernel declaration replaced by its ``hal.executable`` (variant
    target ``target``, object ``obj``) and each call by a ``flow.dispatch``."""
    by_name = {c.name: c for c in calls}

    def executable(m: re.Match[str]) -> str:
        c = by_name[m.group(1)]
        return ukernel.executable_mlir(c.name, obj, c.shape, c.nparams, c.nweights, c.residual,
                                       target, entry=c.name)

    text = _DECL.sub(executable, text)
    return _CALL.sub(lambda m: f"flow.dispatch @{m.group(1)}::@x86::@{m.group(1)}(", text)


@dataclass(frozen=True)
class Support:
    """Whether this compile lowers conv chains to the microkernel: its object, or why not."""

    obj: Path | None
    why: str


def support(wanted: bool | None) -> Support:
    """``wanted`` None: on when the host has AVX-512 VNNI and gcc builds the kernel."""
    from qcompile.errors import CompileError

    if wanted is False:
        return Support(None, "off (compile option ukernel_convs: false)")
    if not ukernel.host_has_vnni():
        return Support(None, "the host CPU has no AVX-512 VNNI (avx512f/bw/dq/vl, avx512_vnni)")
    try:
        obj = ukernel.build_object()
    except CompileError as err:
        return Support(None, f"{err.what}: {err.why}" if err.why else err.what)
    return Support(obj, f"AVX-512 VNNI host, kernel built by gcc ({obj.name})")

"""QIR → MLIR (func/linalg/arith/tensor/math on tensors), built with IREE's bundled MLIR bindings
and verified before it is handed to ``iree-compile``.

One emitter per op kind, registered with :func:`emits`. Every op an emitter builds carries the
location ``qir<K>`` of its QIR node (``qir<K>.copy`` for im2col/pad copies), so the dispatches
IREE forms can be traced back to fused chains (:mod:`qcompile.codegen.kernels`).

Integer arithmetic follows :mod:`qcompile.ir.qmath` exactly; contractions are u8 × s8 with the
activation zero point folded into the bias (see :mod:`qcompile.codegen.emit_contract`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, func, math

from qcompile.codegen import builder as b
from qcompile.codegen.builder import TV
from qcompile.errors import CompileError
from qcompile.ir import qmath
from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op
from qcompile.ir.types import DType, Requant


@dataclass(frozen=True)
class Acc:
    """An i32 contraction result whose per-channel bias (i32, zero-point terms folded in) is
    added by its consumer's epilogue, so the accumulator init stays a plain zero fill."""

    tv: TV
    bias: np.ndarray | None      # per channel along ``axis``
    axis: int


@dataclass(frozen=True)
class Pending:
    """A contraction whose chain the VNNI microkernel computes
    (:mod:`qcompile.codegen.emit_ukernel`): its activation (and a matmul's second operand),
    handed to the requantize that ends the chain (its only reader)."""

    x: TV
    y: TV | None = None


@dataclass(frozen=True)
class Fused:
    """A node whose value a fused kernel computes and nothing else reads: inside an attention
    chain (:func:`qcompile.codegen.emit_ukernel.attention_chains`), or a requantize whose
    table the kernel stores (:func:`qcompile.codegen.fusions.table_reader`)."""

    node_id: int


Value = TV | Acc | Pending | Fused
Emit = Callable[["Emitter", Node, list[Value]], Value]
_EMITTERS: dict[Op, Emit] = {}


def emits(*ops: Op) -> Callable[[Emit], Emit]:
    def add(fn: Emit) -> Emit:
        for op in ops:
            _EMITTERS[op] = fn
        return fn

    return add


def supported_ops() -> frozenset[Op]:
    _load_emitters()
    return frozenset(_EMITTERS)


def _load_emitters() -> None:
    from qcompile.codegen import (  # noqa: F401 - registers emitters
        emit_contract,
        emit_float,
        emit_norm,
        emit_softmax,
    )


@dataclass(frozen=True)
class EmitOptions:
    """Variants of the lowering used by the workaround ladder (``qcompile.codegen.cpu``).

    ``split_dequant``: fence contractions from their dequantize epilogues. ``s8_contractions``:
    contractions as s8 × s8 (activations flipped, zero point - 128), the form IREE's mmt4d
    ukernels take when the u8 inner-tiled path is off (u8 × s8 then falls to untiled code).
    ``ukernel_convs``: conv → requantize chains the VNNI microkernel supports become its
    dispatch (:mod:`qcompile.codegen.emit_ukernel`); the module text then needs
    :func:`qcompile.codegen.emit_ukernel.link` before iree-compile. ``cpu_strategies``: preset
    IREE llvm-cpu tile strategies (``compilation_info``) on ops whose default strategy is slow;
    off for the GPU targets, whose pipelines reject a CPU strategy. ``winograd``: with the
    microkernel, 3x3 stride-1 convs as exact Winograd F(4x4, 3x3) where they fit
    (:func:`qcompile.codegen.ukernel.wino_fits`)."""

    split_dequant: bool = False
    s8_contractions: bool = False
    ukernel_convs: bool = False
    cpu_strategies: bool = True
    winograd: bool = True


class Emitter:
    def __init__(self, graph: Graph, opts: EmitOptions | None = None) -> None:
        self.graph = graph
        self.opts = opts or EmitOptions()
        self.ids = {id(n): k for k, n in enumerate(graph.nodes())}
        self.users = graph.users()
        from qcompile.codegen import emit_ukernel

        self.uk_chains, self.uk_stock = emit_ukernel.plan(graph, self.users) \
            if self.opts.ukernel_convs else ({}, {})
        self.uk_calls: list[emit_ukernel.UkCall] = []
        # linears sharing their input, one dispatch (emit_ukernel.linear_groups), and the
        # requantize outputs their call has produced
        self.uk_groups = emit_ukernel.linear_groups(graph, self.uk_chains, self.users)
        # float adds a microkernel dequantize computes in its epilogue (dequantize id → (add,
        # residual)): the add's value is that call's output
        self.uk_float_add = emit_ukernel.float_residuals(graph, self.uk_chains, self.users)
        self.uk_group_out: dict[int, TV] = {}
        # attention chains the fused kernel computes (node id → chain), and why the others
        # are not fused
        self.uk_attention, self.uk_attention_stock = emit_ukernel.attention_chains(
            graph, self.users) if self.opts.ukernel_convs else ({}, {})
        for why, count in self.uk_attention_stock.items():
            self.uk_stock[f"attention: {why}"] = count
        self.module: ir.Module | None = None
        self.values: dict[int, Value] = {}     # emitted so far (node id → value)
        # microkernel outputs written with the border their readers pad them by: node id →
        # (padded tensor, (border rows, border columns), fill) (emit_ukernel.out_border)
        self.prepadded: dict[int, tuple[TV, tuple[int, int], int]] = {}
        # f32 tensors a microkernel quantize reads whole: in a pooled module it reports a NaN
        # or infinity among them (the input check, iree_cpu.Module)
        self.uk_checked: set[int] = set()

    def inputs_checked(self) -> bool:
        """Whether every f32 graph input is read whole by a microkernel quantize."""
        return all(id(x) in self.uk_checked for x in self.graph.inputs if x.dtype is DType.F32)

    def loc(self, n: Node, part: str = "") -> ir.Location:
        return ir.Location.name(f"qir{self.ids[id(n)]}{part}")

    def emit_node(self, n: Node, operands: list[Value]) -> Value:
        fn = _EMITTERS.get(n.op)
        if fn is None:
            raise unsupported(n, "no CPU lowering for this op")
        att = self.uk_attention.get(id(n))
        if att is not None:
            from qcompile.codegen import emit_ukernel

            if n is att.rq2:
                emit_ukernel.emit_attention(self, att)
            return Fused(id(n))
        with self.loc(n):
            out = fn(self, n, operands)
            # a transpose reading an epilogue would pull it out of its contraction's dispatch
            # (IREE fuses the elementwise epilogue with the transpose and writes i32 instead)
            if isinstance(out, TV) and _is_epilogue(n) and any(
                    u.op is Op.PERMUTE for u in self.users.get(id(n), [])):
                out = b.barrier(out)
            return out


def unsupported(n: Node, why: str) -> CompileError:
    return CompileError(f"cpu: cannot lower QIR op '{n.op.value}'", at=f"{n.loc} "
                        f"({n.dtype.value}{list(n.shape)})", why=why,
                        next="keep the op out of the int8 region (quantizer skip list) or use "
                             "target 'reference'")


def emit_module(graph: Graph, opts: EmitOptions | None = None) -> ir.Module:
    """The MLIR module of ``graph`` with one public function ``main`` (inputs → outputs)."""
    return emit(graph, opts)[0]


def emit(graph: Graph, opts: EmitOptions | None = None) -> tuple[ir.Module, Emitter]:
    """The module and its emitter (which holds the microkernel calls to link)."""
    _load_emitters()
    ctx = ir.Context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        em = Emitter(graph, opts)
        em.module = module
        arg_types = [b.tensor_type(n.shape, n.dtype) for n in graph.inputs]
        with ir.InsertionPoint(module.body):
            @func.FuncOp.from_py_func(*arg_types, name="main")
            def main(*args: ir.Value) -> list[ir.Value]:
                values = em.values
                values.update({id(n): TV(a, n.dtype, n.shape)
                               for n, a in zip(graph.inputs, args, strict=True)})
                for n in graph.nodes():
                    if id(n) not in values:
                        values[id(n)] = em.emit_node(n, [values[id(s)] for s in n.src])
                return [materialize(values[id(o)]) .value for o in graph.outputs]

            del main
        if not module.operation.verify():
            raise CompileError("cpu: the emitted MLIR does not verify", why=str(module)[:2000])
    return module, em


# -- shared scalar rules -------------------------------------------------------------------

def materialize(v: Value) -> TV:
    """The i32 value of an :class:`Acc` with its bias added (when a non-epilogue reads it)."""
    if isinstance(v, TV):
        return v
    if isinstance(v, Pending):
        raise CompileError("cpu: a microkernel conv's accumulator has another reader",
                           why="emit_ukernel.plan selected a chain it should not have")
    if isinstance(v, Fused):
        raise CompileError("cpu: a value inside a fused attention chain has another reader",
                           why="emit_ukernel.attention_chains selected a chain it should not "
                               "have")
    if v.bias is None:
        return v.tv
    table = b.constant(v.bias.astype(np.int32), DType.I32)

    def body(acc: ir.Value, _o: ir.Value) -> ir.Value:
        return arith.addi(acc, b.extract(table, b.channel_index(v.axis)))

    return b.elementwise([v.tv], v.tv.shape, DType.I32, body)


def per_channel(values: tuple[int, ...] | np.ndarray, bits: int, axis: int | None
                ) -> Callable[[], ir.Value]:
    """A body-time getter of ``values[c]`` (a scalar constant when there is one value)."""
    arr = np.asarray(values, dtype=np.int64)
    if arr.size == 1 or axis is None:
        return lambda: b.ci(int(arr.reshape(-1)[0]), bits)
    table = b.constant(arr.astype(np.int64 if bits == 64 else np.int32),
                       DType.I64 if bits == 64 else DType.I32)
    return lambda: b.extract(table, b.channel_index(axis))


@emits(Op.CONST)
def _const(em: Emitter, n: Node, v: list[Value]) -> Value:
    return b.constant(np.asarray(n.attrs.value), n.dtype)


@emits(Op.REQUANT)
def _requant(em: Emitter, n: Node, v: list[Value]) -> Value:
    """``clamp(round_shift(sum (x_i + bias_i - z_i) * M_i[c], s[c]) + zp)`` in i64, or with
    the same result in i32 lanes where :func:`narrow_requant` allows."""
    rq: Requant = n.attrs.rq
    if isinstance(v[0], Pending):
        from qcompile.codegen import emit_ukernel

        return emit_ukernel.emit(em, n, v[0], materialize(v[1]) if len(v) == 2 else None)
    # an int8 residual operand is fenced: otherwise IREE pulls its producer's epilogue into this
    # dispatch and writes that producer's i32 accumulator to memory instead
    tvs = [x.tv if isinstance(x, Acc) else (b.barrier(x) if i and _is_epilogue(n.src[i])
                                               else x) for i, x in enumerate(v)]
    if narrow_requant(n, v):
        return _requant_narrow(n, v, tvs)
    biases, mults = _term_tables(v, rq, 64)
    shift = per_channel(rq.shift, 64, rq.axis)
    rounding = per_channel(tuple(1 << (s - 1) for s in rq.shift), 64, rq.axis)

    def body(*args: ir.Value) -> ir.Value:
        total = _term_sum(args, tvs, rq, biases, mults, 64)
        rounded = arith.shrsi(arith.addi(total, rounding()), shift())
        out = b.clamp_int(arith.addi(rounded, b.ci(rq.zp_out, 64)), rq.qmin, rq.qmax, 64)
        return arith.trunci(b.int_type(8), out)

    return b.elementwise(tvs, n.shape, n.dtype, body)


def _term_tables(v: list[Value], rq: Requant, bits: int) -> tuple[list, list]:
    """Body-time getters of each term's bias (an accumulator's, else None) and multiplier."""
    biases = [per_channel(x.bias, bits, x.axis) if isinstance(x, Acc) and x.bias is not None
              else None for x in v]
    return biases, [per_channel(t.multiplier, bits, rq.axis) for t in rq.terms]


def _term_sum(args: Sequence[ir.Value], tvs: list[TV], rq: Requant, biases: list, mults: list,
              bits: int) -> ir.Value:
    """``sum (x_i + bias_i - z_i) * M_i`` in i64, each centred term formed in ``bits``: 64, or 32
    with both factors sign-extended, an i32 x i32 -> i64 product (``vpmuldq``)."""
    i64 = b.int_type(64)
    total = None
    for x, t, term, bias, mult in zip(args, tvs, rq.terms, biases, mults, strict=False):
        xc = b.widen(x, t.dtype, bits)
        if bias is not None:
            xc = arith.addi(xc, bias())
        if term.zero_point:
            xc = arith.subi(xc, b.ci(term.zero_point, bits))
        prod = arith.muli(xc, mult()) if bits == 64 else \
            arith.muli(arith.extsi(i64, xc), arith.extsi(i64, mult()))
        total = prod if total is None else arith.addi(total, prod)
    assert total is not None
    return total


def anchor_bound(n: Node) -> int | None:
    """An upper bound of ``|value|`` of an anchor's i32 result (bias included), or ``None``."""
    if n.op in (Op.QCONV2D, Op.QLINEAR):
        w, bias = (np.asarray(s.attrs.value) for s in n.src[1:3])
        return 65536 * int(np.prod(w.shape[1:])) + int(np.max(np.abs(bias), initial=0))
    if n.op is Op.QMATMUL:
        return 65536 * int(n.src[0].shape[-1])
    if n.op is Op.QMUL:
        return 65536
    if n.op is Op.QSUMPOOL2D:
        return 256 * int(np.prod(n.attrs.kernel))
    if n.op is Op.QSUM:
        return 256 * max(1, int(np.prod(n.src[0].shape)) // max(1, int(np.prod(n.shape))))
    return None


def narrow_requant(n: Node, v: list[Value]) -> bool:
    """Whether a requantize may run in i32 lanes: each centred term ``x + bias - z`` fits in
    i32, every multiplier is below 2^31, the product sum ``T`` stays below 2^62 and every shift
    is at least 33, so that ``(T + 2^(s-1)) >> s == ((T >> 32) + 2^(s-33)) >> (s - 32)`` (floor
    shifts compose): the products are i32 x i32 -> i64 (``vpmuldq``), the rest i32."""
    rq: Requant = n.attrs.rq
    if min(rq.shift) < 33:
        return False
    total = 0
    for src, x, term in zip(n.src, v, rq.terms, strict=True):
        if src.op in ANCHOR_OPS:
            bound = anchor_bound(src)
        elif not isinstance(x, Acc) and src.dtype in (DType.I8, DType.U8):
            bound = 255
        else:
            bound = None
        if bound is None:
            return False
        bound += abs(term.zero_point)
        mult = max(np.asarray(term.multiplier, dtype=np.int64).reshape(-1))
        if bound >= 2**31 or mult >= 2**31 or min(np.asarray(term.multiplier).reshape(-1)) < 0:
            return False
        total += bound * int(mult)
    return total < 2**62


def _requant_narrow(n: Node, v: list[Value], tvs: list[TV]) -> TV:
    rq: Requant = n.attrs.rq
    biases, mults = _term_tables(v, rq, 32)
    shift = per_channel(tuple(s - 32 for s in rq.shift), 32, rq.axis)
    rounding = per_channel(tuple(1 << (s - 33) for s in rq.shift), 32, rq.axis)
    def body(*args: ir.Value) -> ir.Value:
        total = _term_sum(args, tvs, rq, biases, mults, 32)
        high = arith.trunci(b.int_type(32), arith.shrsi(total, b.ci(32, 64)))
        rounded = arith.shrsi(arith.addi(high, rounding()), shift())
        out = b.clamp_int(arith.addi(rounded, b.ci(rq.zp_out, 32)), rq.qmin, rq.qmax, 32)
        return arith.trunci(b.int_type(8), out)

    return b.elementwise(tvs, n.shape, n.dtype, body)


def _is_epilogue(n: Node) -> bool:
    return n.op in (Op.REQUANT, Op.DEQUANT) and bool(n.src) and n.src[0].op in ANCHOR_OPS


@emits(Op.QUANT)
def _quant(em: Emitter, n: Node, v: list[Value]) -> Value:
    """PT2E's quantize: ``clamp(roundeven(x * (1/s)) + zp)`` in f32."""
    qp = n.attrs.qp
    x = materialize(v[0])
    inv = np.float32(1.0) / np.asarray(qp.scale, dtype=np.float32)
    axis = qp.axis
    inv_f = _f32_channel(inv, axis)
    zp_f = _f32_channel(np.asarray(qp.zero_point, dtype=np.float32), axis)

    def body(a: ir.Value, _o: ir.Value) -> ir.Value:
        r = arith.addf(math.roundeven(arith.mulf(a, inv_f())), zp_f())
        r = arith.minimumf(arith.maximumf(r, b.cf(qp.qmin)), b.cf(qp.qmax))
        return arith.trunci(b.int_type(8), arith.fptosi(b.int_type(32), r))

    return b.elementwise([x], n.shape, n.dtype, body)


def _f32_channel(values: np.ndarray, axis: int | None) -> Callable[[], ir.Value]:
    if values.size == 1 or axis is None:
        return lambda: b.cf(float(values.reshape(-1)[0]))
    table = b.constant(values.astype(np.float32), DType.F32)
    return lambda: b.extract(table, b.channel_index(axis))


@emits(Op.DEQUANT)
def _dequant(em: Emitter, n: Node, v: list[Value]) -> Value:
    """``f32((x + bias - zp) * m[c]) * 2^-sh[c]`` (``qmath.dequantize_array``)."""
    qp = n.attrs.qp
    src = v[0]
    if isinstance(src, Pending):
        from qcompile.codegen import emit_ukernel

        return emit_ukernel.emit_dequant(em, n, src)
    # a dequantize that feeds a float island (not just a graph output) is fenced from its GEMM:
    # fused, IREE 3.13's LLVM serialization of that dispatch is pathological (MiniLM, whose
    # out-projection and FFN-down dequantize into the float residual stream: 287 s in
    # SerializeTargetExecutablesPass against 9 s for the whole module fenced); the fence costs
    # one i32 write of the accumulator
    if isinstance(src, Acc) and (em.opts.split_dequant or em.users.get(id(n))):
        src = Acc(b.barrier(src.tv), src.bias, src.axis)
    x = src.tv if isinstance(src, Acc) else src
    bias = per_channel(src.bias, 64, src.axis) if isinstance(src, Acc) and \
        src.bias is not None else None
    zps = np.asarray(qp.zero_point)
    zp = per_channel(qp.zero_point, 64, qp.axis) if np.any(zps) else None
    m_values, p_values = qmath.scale_fixed(np.asarray(qp.scale))
    m = per_channel(m_values, 64, qp.axis)
    power = _f32_channel(p_values, qp.axis)

    def body(a: ir.Value, _o: ir.Value) -> ir.Value:
        a64 = b.widen(a, x.dtype, 64)
        if bias is not None:
            a64 = arith.addi(a64, bias())
        if zp is not None:
            a64 = arith.subi(a64, zp())
        # qmath.dequantize_array: an exact product by a power of two, so an add that LLVM
        # contracts with it into a fused multiply-add rounds the same
        return arith.mulf(arith.sitofp(ir.F32Type.get(), arith.muli(a64, m())), power())

    return b.elementwise([x], n.shape, DType.F32, body)


@emits(Op.LUT)
def _lut(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    table = b.constant(np.asarray(n.attrs.table), n.dtype)
    lo = n.src[0].dtype.range[0]

    def body(a: ir.Value, _o: ir.Value) -> ir.Value:
        i = arith.subi(b.widen(a, x.dtype, 32), b.ci(lo, 32))
        return b.extract(table, arith.index_cast(ir.IndexType.get(), i))

    return b.elementwise([x], n.shape, n.dtype, body)


@emits(Op.MASK_LUT)
def _mask_lut(em: Emitter, n: Node, v: list[Value]) -> Value:
    """``table[clamp(m, -1, 2) + 1][x - lo]``, the mask broadcast onto the codes."""
    x, m = materialize(v[0]), materialize(v[1])
    width = n.attrs.table.shape[1]
    table = b.constant(np.asarray(n.attrs.table).reshape(-1), n.dtype)
    lo = n.src[0].dtype.range[0]

    def body(a: ir.Value, mask: ir.Value, _o: ir.Value) -> ir.Value:
        row = b.clamp_int(b.widen(mask, m.dtype, 64), -1, 2, 64)
        row = arith.trunci(b.int_type(32), arith.addi(row, b.ci(1, 64)))
        i = arith.addi(arith.muli(row, b.ci(width, 32)),
                       arith.subi(b.widen(a, x.dtype, 32), b.ci(lo, 32)))
        return b.extract(table, arith.index_cast(ir.IndexType.get(), i))

    return b.elementwise([x, m], n.shape, n.dtype, body)


# -- data movement (any dtype) --------------------------------------------------------------

@emits(Op.RESHAPE)
def _reshape(em: Emitter, n: Node, v: list[Value]) -> Value:
    return b.reshape(materialize(v[0]), n.shape)


@emits(Op.PERMUTE)
def _permute(em: Emitter, n: Node, v: list[Value]) -> Value:
    return b.transpose(materialize(v[0]), n.attrs.dims)


@emits(Op.CAT)
def _cat(em: Emitter, n: Node, v: list[Value]) -> Value:
    parts = [materialize(x) for x in v]
    axis = n.attrs.axis % len(n.shape)
    out = TV(b.empty(n.shape, n.dtype), n.dtype, n.shape)
    offset = 0
    for p in parts:
        offsets = [0] * len(n.shape)
        offsets[axis] = offset
        out = b.insert_slice(p, out, offsets, p.shape)
        offset += p.shape[axis]
    return out


def scalar_of(dtype: DType, value: float | int) -> ir.Value:
    if dtype is DType.F32:
        return b.cf(float(value))
    return b.ci(int(value), 8 if dtype.is_int8 else 32)


@emits(Op.PAD)
def _pad(em: Emitter, n: Node, v: list[Value]) -> Value:
    x = materialize(v[0])
    pads = n.attrs.pads
    before, after = [0] * len(x.shape), [0] * len(x.shape)
    for i in range(len(pads) // 2):   # torch order: last dim first
        before[len(x.shape) - 1 - i] = pads[2 * i]
        after[len(x.shape) - 1 - i] = pads[2 * i + 1]
    if any(p < 0 for p in (*before, *after)):
        raise unsupported(n, "negative padding (cropping) has no CPU lowering")
    with em.loc(n, ".copy"):
        return b.pad(x, before, after, scalar_of(n.dtype, n.attrs.value))

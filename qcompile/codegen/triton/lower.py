"""QIR (after the pass pipeline) → a :class:`~qcompile.codegen.triton.program.Program`.

Walks the graph once in topological order. A fused chain — an integer anchor (conv, linear,
matmul, mul, sum pool, sum) whose only reader is the REQUANT or DEQUANT that ends it — becomes
one step: one kernel with the epilogue in registers (:mod:`qcompile.codegen.triton.contract`).
Every other node gets its own step: an elementwise kernel (quantize, dequantize, requantize, lut),
a pool kernel, a torch op for data movement, or, for what has no GPU lowering (float
fallbacks), the reference interpreter on the host; host steps are listed with their reason.

``conv``: ``auto`` (tile rules of :mod:`qcompile.codegen.triton.tiles`), ``igemm`` or ``direct``
forces one convolution algorithm (tests run both on every grouped convolution).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from qcompile.codegen.fusions import Attention, attention_chains, scalar_requant, table_reader
from qcompile.codegen.triton import contract
from qcompile.codegen.triton.epilogue import EPI_REQUANT_LUT, end_axis, epilogue, flat_channels
from qcompile.codegen.triton.program import OUT, TORCH_DTYPE, Launch, Program, Ref, Step
from qcompile.codegen.triton.tiles import flat_block
from qcompile.errors import CompileError
from qcompile.ir import qmath
from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op
from qcompile.ir.types import DType
from qcompile.reference import interpreter

I32_LIMIT = 2**31
Lowering = Callable[["Lowerer", Node], "Step | None"]
_SIMPLE: dict[Op, Lowering] = {}


def lowers(*ops: Op) -> Callable[[Lowering], Lowering]:
    def add(fn: Lowering) -> Lowering:
        for op in ops:
            _SIMPLE[op] = fn
        return fn

    return add


class Lowerer:
    """Lowering state of one graph: node keys, users, device constants."""

    def __init__(self, graph: Graph, module: ModuleType, device: torch.device,
                 conv: str = "auto") -> None:
        self.graph, self.module, self.device, self.conv = graph, module, device, conv
        self.nodes = graph.nodes()
        self.keys = {id(n): k for k, n in enumerate(self.nodes)}
        self.users = graph.users()
        self.constants: dict[int, torch.Tensor] = {}
        outputs = {id(o) for o in graph.outputs}
        # a requantize read only by a 256-entry table (GELU after FFN in): the kernel that
        # ends in that requantize stores the table's entries (epilogue.EPI_REQUANT_LUT)
        self.tables = {id(n): t for n in self.nodes
                       if (t := table_reader(n, self.users, outputs)) is not None}
        self.fused_tables: set[int] = set()      # the LUTs a chain's kernel computes

    def table_after(self, end: Node | None) -> Node | None:
        """The table lookup that is ``end``'s only reader (:attr:`tables`), if any."""
        return self.tables.get(id(end)) if end is not None else None

    def key(self, n: Node) -> int:
        return self.keys[id(n)]

    def ref(self, n: Node, *, expand: tuple[int, ...] | None = None,
            view: tuple[int, ...] | None = None) -> Ref:
        """A run-time operand; a constant is uploaded once."""
        if n.op is Op.CONST and self.key(n) not in self.constants:
            self.constants[self.key(n)] = self.tensor(np.asarray(n.attrs.value))
        return Ref(self.key(n), TORCH_DTYPE[n.dtype], expand, view)

    def tensor(self, value: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(value)
        if not arr.flags.writeable:
            arr = arr.copy()
        return torch.from_numpy(arr).to(self.device)

    def step(self, n: Node, covers: tuple[Node, ...], launch: Launch, label: str) -> Step:
        if any(_numel(x.shape) >= I32_LIMIT for x in (n, *n.src)):
            raise CompileError(f"cuda: cannot lower {label}", at=f"{n.loc} "
                               f"({n.dtype.value}{list(n.shape)})",
                               why="the kernels index with i32: a tensor has 2^31 elements or more",
                               next="compile a smaller batch size (compile.batch_sizes)")
        if launch.consts.get("EPI") == EPI_REQUANT_LUT:     # the step stores the table's value
            lut = self.tables[id(n)]
            self.fused_tables.add(id(lut))
            n, covers, label = lut, (*covers, lut), f"{label}+{lut.op.value}"
        loc = next((c.loc for c in (*covers, n) if c.loc), None)   # the anchor's, if it has one
        return Step(self.key(n), tuple(self.key(c) for c in covers), "kernel", n.shape,
                    TORCH_DTYPE[n.dtype], label, launch=launch, loc=loc)

    def chain_end(self, anchor: Node) -> Node | None:
        """The REQUANT/DEQUANT that is ``anchor``'s only reader and reads it first, if any."""
        readers = self.users.get(id(anchor), [])
        if len(readers) != 1 or anchor.op not in ANCHOR_OPS:
            return None
        end = readers[0]
        if end.op not in (Op.REQUANT, Op.DEQUANT) or end.src[0] is not anchor or any(
                s is anchor for s in end.src[1:]):
            return None
        return end


ATTENTION_MAX_S = 512          # keys of one attention row (one tile)
ATTENTION_MAX_D = 128


def attention_fits(s: int, d: int) -> str | None:
    """``None`` when the fused attention kernel takes ``s`` keys of head size ``d``."""
    if s > ATTENTION_MAX_S:
        return f"{s} keys exceed one tile of {ATTENTION_MAX_S}"
    if d > ATTENTION_MAX_D:
        return f"head size {d} exceeds {ATTENTION_MAX_D}"
    return None


def lower_graph(graph: Graph, module: ModuleType, device: torch.device,
                conv: str = "auto") -> Program:
    lw = Lowerer(graph, module, device, conv)
    chains: dict[int, Step] = {}            # end node -> the step of its whole chain
    steps: list[Step] = []
    fused, _ = attention_chains(graph, lw.users, attention_fits)
    for n in lw.nodes:
        if n.op in (Op.INPUT, Op.CONST):
            continue
        if id(n) in lw.fused_tables:       # computed by its requantize's kernel
            continue
        att = fused.get(id(n))
        if att is not None:                 # one kernel at its second requantize
            if n is att.rq2:
                steps.append(attention_step(lw, att))
            continue
        end = lw.chain_end(n) if n.op in ANCHOR_OPS else None
        if end is not None and (chain := lower_anchor(lw, n, end)) is not None:
            chains[id(end)] = chain         # emitted at the end: its residual is ready then
            continue
        if id(n) in chains:
            step: Step | None = chains.pop(id(n))
        elif n.op in ANCHOR_OPS:
            step = lower_anchor(lw, n, None)
        else:
            step = _SIMPLE[n.op](lw, n) if n.op in _SIMPLE else None
        steps.append(step if step is not None else host_step(lw, n))
    return Program(module, device, tuple(lw.key(n) for n in graph.inputs),
                   tuple(lw.key(n) for n in graph.outputs), lw.constants, steps)


def attention_step(lw: Lowerer, att: Attention) -> Step:
    """The fused attention kernel of ``att``; its value is the head merge's."""
    nb, h, s, d = att.qk.src[0].shape
    qa, pa, sa = att.qk.attrs, att.pv.attrs, att.softmax.attrs
    off = {DType.U8: 128, DType.I8: 0}
    q_off, k_off, v_off = (off[x.dtype] for x in (att.q, att.k, att.v))
    zq, zk, zv = int(qa.a_zp) - q_off, int(qa.b_zp) - k_off, int(pa.b_zp) - v_off
    zp = int(pa.a_zp) - 128

    def rq_args(n: Node) -> tuple[int, ...]:
        bias, m, sh, *out = scalar_requant(n)
        return (bias, m, 1 << (sh - 1), sh, *out)

    mask = att.mask.src[1] if att.mask is not None else None
    mtab = np.asarray(att.mask.attrs.table, np.int64).reshape(-1) if att.mask is not None \
        else np.zeros(1, np.int64)
    bs = max(32, 1 << (s - 1).bit_length())         # int8 dots reduce over K >= 32
    bd = max(32, 1 << (d - 1).bit_length())
    bq = 16 if bs > 128 else 32
    args = (lw.ref(att.q), lw.ref(att.k), lw.ref(att.v),
            lw.ref(mask) if mask is not None else OUT,
            lw.tensor(mtab.astype(np.int32)),
            lw.tensor(np.asarray(sa.table, np.int64)), OUT, s, h * d, d,
            s if mask is not None and mask.shape[0] > 1 else 0, zq, zk, zv, zp, d * zq * zk,
            s * zp * zv, *rq_args(att.rq1), 2 * int(sa.m), int(sa.zp), *map(int, sa.range),
            *rq_args(att.rq2))
    consts = {"Q_OFF": q_off, "K_OFF": k_off, "V_OFF": v_off, "HAS_MASK": mask is not None,
              "CLO": att.rq1.dtype.range[0], "SHIFT": qmath.SOFTMAX_OUT_SHIFT, "BQ": bq,
              "BS": bs, "BD": bd}
    merge = att.merge[1]
    return lw.step(merge, (*att.inner, *att.merge),
                   Launch("attention", (-(-s // bq), h, nb), args, consts,
                          tile=f"{bq}x{bs}x{bd}"), "attention")


def lower_anchor(lw: Lowerer, anchor: Node, end: Node | None) -> Step | None:
    """The step of a chain (``end``: its REQUANT/DEQUANT, or ``None`` to store i32)."""
    if anchor.op is Op.QMUL:
        covers = (anchor,) if end is None else (anchor, end)
        return flat_epilogue_step(lw, end or anchor, covers, anchor.src[0], anchor.src[1],
                                  (anchor.attrs.a_zp, anchor.attrs.b_zp))
    return contract.ANCHORS[anchor.op](lw, anchor, end)


def host_step(lw: Lowerer, n: Node) -> Step:
    """``n`` run by the reference interpreter on the host (exact by construction, slow)."""
    srcs = [s for s in n.src if s.op is not Op.CONST]
    reason = n.attrs.get("fallback") or f"no cuda lowering for {n.op.value}" + (
        "" if n.dtype.is_float else f" ({n.dtype.value}{list(n.shape)})")

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        values = [np.asarray(s.attrs.value) if s.op is Op.CONST else next(it).cpu().numpy()
                  for s in n.src]
        return lw.tensor(np.asarray(interpreter.execute(n, values)))

    return Step(lw.key(n), (lw.key(n),), "host", n.shape, TORCH_DTYPE[n.dtype], n.op.value,
                fn=run, inputs=tuple(lw.ref(s) for s in srcs), reason=str(reason))


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _flat_grid(n: Node) -> tuple[tuple[int, int, int], int]:
    block = flat_block(n.numel)
    return (-(-n.numel // block), 1, 1), block


def flat_epilogue_step(lw: Lowerer, end: Node, covers: tuple[Node, ...], x0: Node,
                       x1: Node | None, mul: tuple[int, int] | None) -> Step | None:
    """``requant_flat``: an int tensor (or the product of two, ``mul`` = zero points) through
    the epilogue of ``end`` (REQUANT/DEQUANT; ``None`` stores the i32 product)."""
    shape = end.shape
    ends = end.op in (Op.REQUANT, Op.DEQUANT)
    axis = end_axis(end, len(shape)) if ends else None
    ep = epilogue(end if ends else None, shape, axis, 0,
                  lut=lw.table_after(end) if ends else None)
    if ep is None or (mul is not None and ep.residual is not None):
        return None
    second = x1 if mul is not None else ep.residual
    ch, inner = flat_channels(shape, axis)
    grid, block = _flat_grid(end)
    za, zb = mul or (0, 0)
    args = (lw.ref(x0, expand=shape), lw.ref(second, expand=shape) if second is not None
            else OUT, OUT, lw.tensor(ep.table), lw.tensor(ep.scale), end.numel, za, zb, ch,
            inner, *ep.scalars())
    consts = {"MUL": mul is not None, **ep.consts(), "BLOCK": block}
    label = "+".join(c.op.value for c in covers)
    return lw.step(end, covers, Launch("requant_flat", grid, args, consts, tile=f"{block}"),
                   label)


@lowers(Op.REQUANT, Op.DEQUANT)
def _requant(lw: Lowerer, n: Node) -> Step | None:
    if n.op is Op.DEQUANT and n.src[0].dtype.is_float:
        return None
    return flat_epilogue_step(lw, n, (n,), n.src[0], None, None)


@lowers(Op.QUANT)
def _quant(lw: Lowerer, n: Node) -> Step | None:
    qp = n.attrs.qp
    if not n.src[0].dtype.is_float:
        return None
    axis = None if len(qp.scale) == 1 else qp.axis % len(n.shape)
    ch, inner = flat_channels(n.shape, axis)
    inv = (np.float32(1.0) / np.asarray(qp.scale, dtype=np.float32)).astype(np.float32)
    zp = np.asarray(qp.zero_point, dtype=np.float32)
    grid, block = _flat_grid(n)
    args = (lw.ref(n.src[0]), OUT, lw.tensor(np.broadcast_to(inv, (ch,))),
            lw.tensor(np.broadcast_to(zp, (ch,))), n.numel, ch, inner, float(qp.qmin),
            float(qp.qmax))
    return lw.step(n, (n,), Launch("quantize", grid, args, {"BLOCK": block}, tile=f"{block}"),
                   "quant")


@lowers(Op.LUT)
def _lut(lw: Lowerer, n: Node) -> Step:
    grid, block = _flat_grid(n)
    table = lw.tensor(np.asarray(n.attrs.table).astype(n.dtype.np))
    args = (lw.ref(n.src[0]), table, OUT, n.numel)
    consts = {"LO": n.src[0].dtype.range[0], "BLOCK": block}
    return lw.step(n, (n,), Launch("lut", grid, args, consts, tile=f"{block}"), "lut")


@lowers(Op.MASK_LUT)
def _mask_lut(lw: Lowerer, n: Node) -> Step:
    grid, block = _flat_grid(n)
    table = np.asarray(n.attrs.table)
    args = (lw.ref(n.src[0]), lw.ref(n.src[1], expand=n.shape),
            lw.tensor(table.reshape(-1).astype(n.dtype.np)), OUT, n.numel)
    consts = {"LO": n.src[0].dtype.range[0], "WIDTH": table.shape[1], "BLOCK": block}
    return lw.step(n, (n,), Launch("mask_lut", grid, args, consts, tile=f"{block}"), "mask_lut")


@lowers(Op.QSOFTMAX)
def _qsoftmax(lw: Lowerer, n: Node) -> Step | None:
    a = n.attrs
    width = n.shape[-1]
    if a.axis != len(n.shape) - 1 or width > 8192:
        return None           # rows along another axis or longer than one tile: on the host
    block = max(16, 1 << (width - 1).bit_length())
    rows = n.numel // width
    args = (lw.ref(n.src[0]), lw.tensor(np.asarray(a.table, np.int64)), OUT, width, 2 * a.m,
            a.zp, a.range[0], a.range[1])
    consts = {"LO": n.src[0].dtype.range[0], "SHIFT": qmath.SOFTMAX_OUT_SHIFT, "BLOCK": block}
    return lw.step(n, (n,), Launch("qsoftmax", (rows, 1, 1), args, consts, tile=f"{block}"),
                   "qsoftmax")


@lowers(Op.QLAYERNORM)
def _qlayernorm(lw: Lowerer, n: Node) -> Step:
    a, width = n.attrs, n.shape[-1]
    block = max(16, 1 << (width - 1).bit_length())      # rows of at most LN_MAX_N: one tile
    tables = [lw.tensor(np.asarray(t, np.int64)) for t in (a.g, a.b, a.sh)]
    scale = lw.tensor(np.ldexp(np.float32(1.0), -np.asarray(a.sh)).astype(np.float32))
    floating = n.dtype is DType.F32
    zp, lo, hi = (0, 0, 0) if floating else (a.zp, *a.range)
    float_in = n.src[0].dtype is DType.F32           # qmath.layernorm_fixed_float
    root_shift, r_bits, z_shift = qmath.layernorm_shifts(float_in)
    x_zp, code_bits, k_max, e_shift = (0, a.code_bits, a.k_max, a.e_shift) if float_in else \
        (a.x_zp, 0, 0, 0)
    args = (lw.ref(n.src[0]), *tables, scale, OUT, width, x_zp, a.e, 1 << r_bits, zp, lo, hi,
            code_bits, k_max, e_shift)
    consts = {"ROOT_SHIFT": root_shift, "Z_SHIFT": z_shift, "MARGIN": qmath.LN_ISQRT_MARGIN,
              "FLOAT_IN": float_in, "FLOAT_OUT": floating, "BLOCK": block}
    return lw.step(n, (n,), Launch("qlayernorm", (n.numel // width, 1, 1), args, consts,
                                   tile=f"{block}"), "qlayernorm")


@lowers(Op.MAXPOOL2D)
def _maxpool(lw: Lowerer, n: Node) -> Step | None:
    return contract.maxpool(lw, n)


def _torch_step(lw: Lowerer, n: Node, fn: Callable[..., torch.Tensor],
                srcs: tuple[Node, ...] | None = None) -> Step:
    srcs = n.src if srcs is None else srcs
    return Step(lw.key(n), (lw.key(n),), "torch", n.shape, TORCH_DTYPE[n.dtype], n.op.value,
                fn=fn, inputs=tuple(lw.ref(s) for s in srcs))


@lowers(Op.RESHAPE)
def _reshape(lw: Lowerer, n: Node) -> Step:
    shape = n.shape
    return _torch_step(lw, n, lambda t: t.reshape(shape))


@lowers(Op.PERMUTE)
def _permute(lw: Lowerer, n: Node) -> Step:
    dims = tuple(n.attrs.dims)
    return _torch_step(lw, n, lambda t: t.permute(dims).contiguous())


@lowers(Op.CAT)
def _cat(lw: Lowerer, n: Node) -> Step:
    axis = n.attrs.axis
    return _torch_step(lw, n, lambda *ts: torch.cat(ts, dim=axis))


@lowers(Op.PAD)
def _pad(lw: Lowerer, n: Node) -> Step | None:
    pads = tuple(int(p) for p in n.attrs.pads)
    if any(p < 0 for p in pads):
        return None
    value: Any = np.asarray(n.attrs.value).astype(n.dtype.np).item()
    return _torch_step(lw, n, lambda t: F.pad(t, pads, value=value))

"""The epilogue of a fused chain, packed for :func:`qcompile.codegen.triton.kernels._epilogue`.

A chain ends in a REQUANT (int8 out), a DEQUANT (f32 out, e.g. logits) or nothing (the i32
accumulator is stored because several consumers read it). :func:`epilogue` turns that end node
and the anchor's folded bias into the i64 table ``ep[5, F]`` and the scalars the kernels take;
it returns ``None`` when the kernel at hand cannot index the end's channels (the caller then
stores the accumulator and requantizes in a separate kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qcompile.ir import qmath
from qcompile.ir.graph import Node, Op
from qcompile.ir.types import Requant

EPI_I32, EPI_REQUANT, EPI_DEQUANT, EPI_REQUANT_LUT = 0, 1, 2, 3   # the kernels' ``EPI``
LUT_BASE = 128          # EPI_REQUANT_LUT: the table (in ``scale``) is indexed by code + 128


@dataclass(frozen=True)
class Epilogue:
    mode: int
    table: np.ndarray            # i64 [5, F]
    scale: np.ndarray            # f32 [F]: 2^-sh of a dequantize's scale (m in table[1])
    residual: Node | None        # the second requantize term, read at the output's offsets
    zr: int
    zp_out: int
    qmin: int
    qmax: int

    @property
    def channels(self) -> int:
        return int(self.table.shape[1])

    def scalars(self) -> tuple[int, int, int, int]:
        return self.zr, self.zp_out, self.qmin, self.qmax

    def consts(self) -> dict[str, Any]:
        return {"EPI": self.mode, "HAS_RES": self.residual is not None}


def norm_axis(axis: int | None, ndim: int) -> int | None:
    return None if axis is None else axis % ndim


def epilogue(end: Node | None, shape: tuple[int, ...], axis: int | None,
             bias: np.ndarray | int, lut: Node | None = None) -> Epilogue | None:
    """The epilogue of ``end`` for a kernel whose channel index runs along ``axis`` of the
    output ``shape`` (``None``: one channel). ``bias``: the anchor's folded bias per channel
    (or one value). ``lut``: the 256-entry table that reads a requantize's codes (its only
    reader): the kernel stores the table's entries (``EPI_REQUANT_LUT``; the table as f32 in
    ``scale``, indexed by ``code + 128``, codes being exact in f32)."""
    width = 1 if axis is None else shape[axis]
    base = _broadcast(bias, width, np.int64)
    if base is None:
        return None
    table = np.zeros((5, width), dtype=np.int64)
    table[0] = base
    scale = np.zeros(width, dtype=np.float32)
    if end is None:
        return Epilogue(EPI_I32, table, scale, None, 0, 0, 0, 0)
    if end.op is Op.DEQUANT:
        qp = end.attrs.qp
        zps = _per_channel(qp.zero_point, qp.axis, axis, len(shape), width, np.int64)
        scales = _per_channel(qp.scale, qp.axis, axis, len(shape), width, np.float32)
        if zps is None or scales is None:
            return None
        table[0] -= zps
        table[1], power = qmath.scale_fixed(scales)     # qmath.dequantize_array
        return Epilogue(EPI_DEQUANT, table, power, None, 0, 0, 0, 0)
    assert end.op is Op.REQUANT
    rq: Requant = end.attrs.rq
    if len(rq.terms) > 2:
        return None
    rows = [_per_channel(t.multiplier, rq.axis, axis, len(shape), width, np.int64)
            for t in rq.terms]
    shift = _per_channel(rq.shift, rq.axis, axis, len(shape), width, np.int64)
    if shift is None or any(r is None for r in rows):
        return None
    table[0] -= rq.terms[0].zero_point
    table[1] = rows[0]
    table[3] = np.left_shift(np.int64(1), shift - 1)
    table[4] = shift
    residual, zr = None, 0
    if len(rq.terms) == 2:
        table[2] = rows[1]
        residual, zr = end.src[1], rq.terms[1].zero_point
    if lut is not None:
        lo = end.dtype.range[0]
        codes = np.zeros(LUT_BASE + 256, np.float32)
        codes[lo + LUT_BASE:lo + LUT_BASE + 256] = np.asarray(lut.attrs.table, np.float32)
        return Epilogue(EPI_REQUANT_LUT, table, codes, residual, zr, rq.zp_out, rq.qmin,
                        rq.qmax)
    return Epilogue(EPI_REQUANT, table, scale, residual, zr, rq.zp_out, rq.qmin, rq.qmax)


def _broadcast(values: Any, width: int, dtype: type) -> np.ndarray | None:
    arr = np.asarray(values, dtype=dtype).reshape(-1)
    if arr.size == 1:
        return np.full(width, arr[0], dtype=dtype)
    return arr if arr.size == width else None


def _per_channel(values: Any, own_axis: int | None, axis: int | None, ndim: int, width: int,
                 dtype: type) -> np.ndarray | None:
    """``values`` (per channel along ``own_axis``, or one) as a row of ``width`` along the
    kernel's ``axis``; ``None`` when the two axes differ."""
    arr = np.asarray(values).reshape(-1)
    if arr.size == 1:
        return np.full(width, arr[0], dtype=dtype)
    if norm_axis(own_axis, ndim) != axis:
        return None
    return _broadcast(arr, width, dtype)


def flat_channels(shape: tuple[int, ...], axis: int | None) -> tuple[int, int]:
    """``(CH, CH_INNER)``: the channel of flat index ``o`` is ``(o // CH_INNER) % CH``."""
    if axis is None:
        return 1, 1
    return shape[axis], int(np.prod(shape[axis + 1:], dtype=np.int64))


def end_axis(end: Node | None, ndim: int) -> int | None:
    """The channel axis of a chain end (for kernels that can index any axis)."""
    if end is None:
        return None
    if end.op is Op.DEQUANT:
        qp = end.attrs.qp
        return None if len(qp.scale) == 1 and len(qp.zero_point) == 1 else norm_axis(qp.axis,
                                                                                     ndim)
    rq = end.attrs.rq
    return None if len(rq.shift) == 1 else norm_axis(rq.axis, ndim)

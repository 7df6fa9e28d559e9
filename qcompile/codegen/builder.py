"""A thin layer over IREE's bundled MLIR Python bindings (``iree.compiler.ir``): typed tensor
values, constants, ``linalg.generic`` with a Python body, and the data-movement ops the emitters
share. Everything is built on tensors with static shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor

from qcompile.ir.types import DType

Body = Callable[..., Sequence[ir.Value] | ir.Value]

_ELEM_BITS = {DType.I8: 8, DType.U8: 8, DType.I32: 32, DType.I64: 64, DType.BOOL: 1}


@dataclass(frozen=True)
class TV:
    """A tensor value with its QIR dtype (MLIR integers are signless: u8 and i8 are both i8)."""

    value: ir.Value
    dtype: DType
    shape: tuple[int, ...]


def elem(dtype: DType) -> ir.Type:
    if dtype is DType.F32:
        return ir.F32Type.get()
    return ir.IntegerType.get_signless(_ELEM_BITS[dtype])


def int_type(bits: int) -> ir.Type:
    return ir.IntegerType.get_signless(bits)


def tensor_type(shape: Sequence[int], dtype: DType) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), elem(dtype))


def dims(n: int) -> list[ir.AffineExpr]:
    return [ir.AffineDimExpr.get(i) for i in range(n)]


def amap(n: int, exprs: Sequence[ir.AffineExpr | int]) -> ir.AffineMap:
    return ir.AffineMap.get(n, 0, [e if isinstance(e, ir.AffineExpr)
                                   else ir.AffineConstantExpr.get(e) for e in exprs])


def identity(n: int) -> ir.AffineMap:
    return amap(n, dims(n))


def broadcast_map(shape: Sequence[int], out: Sequence[int]) -> ir.AffineMap:
    """Map of an operand broadcast (numpy rules, right-aligned) onto ``out``."""
    d = dims(len(out))
    lead = len(out) - len(shape)
    exprs: list[ir.AffineExpr | int] = []
    for i, s in enumerate(shape):
        exprs.append(0 if s == 1 and out[lead + i] != 1 else d[lead + i])
    return amap(len(out), exprs)


# -- scalars ---------------------------------------------------------------------------------

def ci(value: int, bits: int) -> ir.Value:
    """An integer constant; 8-bit values 128..255 (u8 codes) are stored as their i8 bits."""
    t = int_type(bits)
    value = int(value)
    if bits == 8 and value > 127:
        value -= 256
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, value)).result


def cf(value: float) -> ir.Value:
    t = ir.F32Type.get()
    return arith.ConstantOp(t, ir.FloatAttr.get(t, float(np.float32(value)))).result


def index_const(value: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(),
                                                                  value)).result


def widen(v: ir.Value, dtype: DType, bits: int) -> ir.Value:
    """Sign- or zero-extend an integer scalar of ``dtype`` to ``bits``."""
    src = _ELEM_BITS[dtype]
    if src == bits:
        return v
    if src > bits:
        return arith.trunci(int_type(bits), v)
    op = arith.extui if dtype in (DType.U8, DType.BOOL) else arith.extsi
    return op(int_type(bits), v)


def clamp_int(v: ir.Value, lo: int, hi: int, bits: int) -> ir.Value:
    return arith.minsi(arith.maxsi(v, ci(lo, bits)), ci(hi, bits))


# -- tensors ---------------------------------------------------------------------------------

def constant(value: np.ndarray, dtype: DType) -> TV:
    arr = np.ascontiguousarray(value.astype(dtype.np, copy=False))
    if dtype is DType.U8:
        arr = arr.view(np.int8)
    if dtype is DType.BOOL:
        attr = ir.DenseElementsAttr.get(arr.astype(np.int8), type=int_type(1),
                                        shape=list(arr.shape))
    else:
        attr = ir.DenseElementsAttr.get(arr, type=elem(dtype), shape=list(arr.shape))
    t = tensor_type(arr.shape, dtype)
    return TV(arith.ConstantOp(t, attr).result, dtype, tuple(arr.shape))


def empty(shape: Sequence[int], dtype: DType) -> ir.Value:
    return tensor.EmptyOp(list(shape), elem(dtype)).result


def filled(shape: Sequence[int], dtype: DType, scalar: ir.Value) -> ir.Value:
    return linalg.fill(scalar, outs=[empty(shape, dtype)])


def generic(inputs: Sequence[ir.Value], in_types: Sequence[DType], out_shape: Sequence[int],
            out_dtypes: Sequence[DType], maps: Sequence[ir.AffineMap], iterators: Sequence[str],
            body: Body, inits: Sequence[ir.Value] | None = None) -> list[ir.Value]:
    """``linalg.generic``; ``body(*in_scalars, *out_scalars)`` returns the yielded values.
    ``inits`` default to ``tensor.empty`` (for purely parallel generics)."""
    outs = list(inits) if inits is not None else [empty(out_shape, d) for d in out_dtypes]
    result_types = [tensor_type(out_shape, d) for d in out_dtypes]
    its = ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{t}>") for t in iterators])
    op = linalg.GenericOp(result_types, list(inputs), outs,
                          ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]), its)
    block = op.regions[0].blocks.append(*[elem(d) for d in (*in_types, *out_dtypes)])
    with ir.InsertionPoint(block):
        got = body(*block.arguments)
        linalg.YieldOp(list(got) if isinstance(got, list | tuple) else [got])
    return list(op.results)


def elementwise(operands: Sequence[TV], out_shape: Sequence[int], out_dtype: DType,
                body: Body) -> TV:
    """A parallel generic over ``out_shape``; operands broadcast onto it."""
    n = len(out_shape)
    maps = [broadcast_map(o.shape, out_shape) for o in operands] + [identity(n)]
    res = generic([o.value for o in operands], [o.dtype for o in operands], out_shape,
                  [out_dtype], maps, ["parallel"] * n, body)
    return TV(res[0], out_dtype, tuple(out_shape))


def barrier(x: TV) -> TV:
    """``util.optimization_barrier``: IREE does not fuse across it."""
    from iree.compiler.dialects import util

    op = util.OptimizationBarrierOp([x.value.type], [x.value])
    return TV(op.results[0], x.dtype, x.shape)


def channel_index(axis: int) -> ir.Value:
    """Inside a generic body: the loop index along ``axis``."""
    return linalg.IndexOp(axis).result


def extract(table: TV, index: ir.Value) -> ir.Value:
    return tensor.ExtractOp(table.value, [index]).result


def reshape(x: TV, shape: Sequence[int]) -> TV:
    """Any static reshape: collapse to 1-D, expand to ``shape``."""
    shape = tuple(shape)
    if shape == x.shape:
        return x
    v = x.value
    numel = int(np.prod(x.shape))
    if len(x.shape) != 1:
        flat = tensor_type([numel], x.dtype)
        v = tensor.CollapseShapeOp(flat, v, _reassoc([list(range(len(x.shape)))])).result
    if len(shape) != 1:
        v = tensor.ExpandShapeOp(tensor_type(shape, x.dtype), v,
                                 _reassoc([list(range(len(shape)))]), [],
                                 ir.DenseI64ArrayAttr.get(list(shape))).result
    elif len(x.shape) == 1:
        pass
    return TV(v, x.dtype, shape)


def _reassoc(groups: list[list[int]]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(int_type(64), i) for i in g])
                             for g in groups])


def transpose(x: TV, perm: Sequence[int]) -> TV:
    perm = tuple(perm)
    if perm == tuple(range(len(perm))):
        return x
    out = tuple(x.shape[p] for p in perm)
    inv = [perm.index(i) for i in range(len(perm))]
    d = dims(len(out))
    maps = [amap(len(out), [d[inv[i]] for i in range(len(perm))]), identity(len(out))]
    res = generic([x.value], [x.dtype], out, [x.dtype], maps, ["parallel"] * len(out),
                  lambda a, _o: a)
    return TV(res[0], x.dtype, out)


def extract_slice(x: TV, offsets: Sequence[int], sizes: Sequence[int],
                  strides: Sequence[int]) -> TV:
    t = tensor_type(sizes, x.dtype)
    v = tensor.ExtractSliceOp(t, x.value, [], [], [], ir.DenseI64ArrayAttr.get(list(offsets)),
                              ir.DenseI64ArrayAttr.get(list(sizes)),
                              ir.DenseI64ArrayAttr.get(list(strides))).result
    return TV(v, x.dtype, tuple(sizes))


def insert_slice(src: TV, dest: TV, offsets: Sequence[int], sizes: Sequence[int]) -> TV:
    """Insert ``src`` (possibly of lower rank: unit dims of ``sizes`` dropped) into ``dest``."""
    v = tensor.InsertSliceOp(src.value, dest.value, [], [], [],
                             ir.DenseI64ArrayAttr.get(list(offsets)),
                             ir.DenseI64ArrayAttr.get(list(sizes)),
                             ir.DenseI64ArrayAttr.get([1] * len(sizes))).result
    return TV(v, dest.dtype, dest.shape)


def pad(x: TV, before: Sequence[int], after: Sequence[int], value: ir.Value) -> TV:
    """Constant padding as fill + insert_slice (IREE fuses this into the consumer)."""
    if not any(before) and not any(after):
        return x
    shape = tuple(s + b + a for s, b, a in zip(x.shape, before, after, strict=True))
    dest = TV(filled(shape, x.dtype, value), x.dtype, shape)
    return insert_slice(x, dest, before, x.shape)

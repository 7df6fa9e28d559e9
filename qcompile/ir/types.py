"""QIR value types: dtypes, quantization parameters, and the fixed-point requantize parameters."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class DType(Enum):
    F32 = "f32"
    I8 = "i8"
    U8 = "u8"
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"

    @property
    def np(self) -> np.dtype:
        return np.dtype({"f32": np.float32, "i8": np.int8, "u8": np.uint8, "i32": np.int32,
                         "i64": np.int64, "bool": np.bool_}[self.value])

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    @property
    def is_int8(self) -> bool:
        return self in (DType.I8, DType.U8)

    @property
    def is_float(self) -> bool:
        return self is DType.F32

    @property
    def range(self) -> tuple[int, int]:
        info = np.iinfo(self.np)
        return int(info.min), int(info.max)

    @classmethod
    def of_numpy(cls, dtype: np.dtype) -> DType:
        for d in cls:
            if d.np == np.dtype(dtype):
                return d
        raise ValueError(f"no QIR dtype for numpy {dtype}")


@dataclass(frozen=True)
class QParams:
    """Affine quantization: ``real = (q - zero_point) * scale``, per tensor (``axis`` None, one
    scale) or per channel along ``axis``."""

    dtype: DType
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    qmin: int
    qmax: int
    axis: int | None = None

    @property
    def per_tensor(self) -> bool:
        return self.axis is None

    @property
    def symmetric(self) -> bool:
        return all(z == 0 for z in self.zero_point)

    def same_as(self, other: QParams) -> bool:
        return self == other

    @property
    def s(self) -> float:
        assert self.per_tensor, "per-channel QParams have no single scale"
        return self.scale[0]

    @property
    def zp(self) -> int:
        assert self.per_tensor, "per-channel QParams have no single zero point"
        return self.zero_point[0]


@dataclass(frozen=True)
class Term:
    """One addend of a requantize: ``(x - zero_point) * multiplier[c]``."""

    zero_point: int
    multiplier: tuple[int, ...]       # per output channel (length 1 = per tensor)


@dataclass(frozen=True)
class Requant:
    """Fixed-point requantize of a sum of integer terms (see :mod:`qcompile.ir.qmath`):

    ``out = clamp(round_shift(sum_i (x_i - z_i) * M_i[c], shift[c]) + zp_out, qmin, qmax)``

    ``axis`` is the channel axis of the output that ``M[c]``/``shift[c]`` index (None: one value).
    """

    terms: tuple[Term, ...]
    shift: tuple[int, ...]
    zp_out: int
    qmin: int
    qmax: int
    out_dtype: DType
    axis: int | None = None

    @property
    def channels(self) -> int:
        return len(self.shift)

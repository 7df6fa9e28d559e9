"""Shape-specialised tile configurations of the ``cuda`` target's kernels.

QIR shapes are static, so every launch gets its block sizes from its own M (output pixels or
rows), N (output channels) and K (reduction length) when the program is built. The rules favour
tiles Triton lowers to the int8 tensor-core instructions: ``mma.sync.m16n8k32`` on sm_80 and,
on sm_90, ``wgmma.mma_async`` (which needs ``BM >= 64`` and four warps per warp group; smaller M,
e.g. a classifier at batch 1, falls back to ``mma.sync``). No tile here was tuned on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DOT = 16           # tl.dot needs every block dimension >= 16
MIN_K = 32             # one int8 MMA step along K


@dataclass(frozen=True)
class Tile:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int

    def describe(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk} w{self.warps} s{self.stages}"


def pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def gemm_tile(m: int, n: int, k: int) -> Tile:
    """Block sizes for an int8 GEMM (or implicit-GEMM convolution) of ``m x n x k``.

    * ``BM``: 128 for big M, 64 from 64 rows (the wgmma minimum), else the next power of two;
    * ``BN``: up to 128, never above the next power of two of N (a 16-channel conv keeps 16);
    * ``BK``: 32 for short reductions (the first conv, K = 27), 64, or 128 from K = 512;
    * 8 warps for 128x128 tiles, else 4; 3 pipeline stages (at most 96 KiB of shared memory).
    """
    bm = 128 if m >= 2048 else 64 if m >= 64 else pow2_at_least(m, MIN_DOT, 64)
    bn = pow2_at_least(n, MIN_DOT, 128)
    bk = 128 if k >= 512 else 64 if k >= 64 else MIN_K
    warps = 8 if bm * bn >= 128 * 128 else 4
    return Tile(bm, bn, bk, warps, 3)


@dataclass(frozen=True)
class WindowTile:
    """Pixels x channels of the direct (CUDA-core) window kernels: depthwise convolutions and
    pools."""

    bm: int
    bc: int
    warps: int = 4

    def describe(self) -> str:
        return f"{self.bm}x{self.bc} w{self.warps}"


def window_tile(m: int, c: int) -> WindowTile:
    bc = pow2_at_least(c, 8, 64)
    bm = pow2_at_least(m, 16, max(16, 4096 // bc))
    return WindowTile(bm, bc)


FLAT_BLOCK = 1024      # elementwise kernels


def flat_block(n: int) -> int:
    return pow2_at_least(n, 128, FLAT_BLOCK)


def conv_algorithm(groups: int, cg: int) -> str:
    """``igemm`` (tensor cores) unless a group is too narrow to fill an MMA tile: depthwise
    and other convolutions with at most 4 input channels per group run ``direct``."""
    return "direct" if groups > 1 and cg <= 4 else "igemm"

#!/usr/bin/env python
"""The depthwise conv microkernel (``qk_dwconv_u8s8``) alone, no IREE: the C source built into
a shared library with a driver that runs every workgroup of one layer on one thread, checked bit
for bit against numpy (qcompile's requantize) and timed (median ms and GOPS).

Usage: .venv/bin/python scripts/ukernel_dw_bench.py [--source conv_vnni.c ...] [--shapes NAME ...]
       [--reps N] [--wide]

Several ``--source`` files are timed side by side (a kernel change against the committed one).

Needs gcc and an AVX-512 VBMI host (the kernel's ``vpermt2b``)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qcompile.codegen import ukernel  # noqa: E402

DRIVER = r"""
#include <stdint.h>
#include <time.h>
void qk_dwconv_u8s8(const uint8_t*, int64_t, const int8_t*, int64_t, const int64_t*, int64_t,
                    const uint8_t*, int64_t, uint8_t*, int64_t, int64_t, int64_t, int64_t);
// ns of each of `reps` passes over every workgroup of the layer
void drive(const uint8_t* x, const int8_t* w, const int64_t* p, uint8_t* y,
           int64_t blocks, int64_t rows, int64_t n, int reps, double* ns) {
  for (int i = 0; i < reps; ++i) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < blocks; ++k)
          qk_dwconv_u8s8(x, 0, w, 0, p, 0, 0, 0, y, 0, k, r, b);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ns[i] = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
  }
}
"""

# name: (N, H, W, C, K (KH = KW), stride, pad); mobilenet_v2's and efficientnet_lite0's layers
# at batch 4, then odd sizes (C = 16 and 48: the 16-channel block; W not a multiple of the step)
SHAPES = {
    "56x56x144-3x3": (4, 56, 56, 144, 3, 1, 1),
    "112x112x96-3x3s2": (4, 112, 112, 96, 3, 2, 1),
    "112x112x32-3x3": (4, 112, 112, 32, 3, 1, 1),
    "14x14x384-3x3": (4, 14, 14, 384, 3, 1, 1),
    "7x7x960-3x3": (4, 7, 7, 960, 3, 1, 1),
    "28x28x240-5x5s2": (4, 28, 28, 240, 5, 2, 2),
    "14x14x480-5x5": (4, 14, 14, 480, 5, 1, 2),
    "28x28x240-5x5": (4, 28, 28, 240, 5, 1, 2),
    "9x11x48-3x3s2": (2, 9, 11, 48, 3, 2, 1),
    "9x13x32-5x5": (2, 9, 13, 32, 5, 1, 2),
    "9x13x48-5x5": (2, 9, 13, 48, 5, 1, 2),
    "8x11x48-4x4": (1, 8, 11, 48, 4, 1, (1, 2)),
    "5x7x16-3x3-nopad": (1, 5, 7, 16, 3, 1, 0),
    "10x10x64-7x7": (1, 10, 10, 64, 7, 1, 3),
    "11x9x80-5x5s2-pad1": (1, 11, 9, 80, 5, 2, 1),
    # unequal strides run row by row (the two-row form is stride 1 only); 10-row kernels in
    # two rows with their loop counts unknown to the compiler, three tap groups and one
    "9x10x32-3x3s(2,1)": (2, 9, 10, 32, 3, (2, 1), 1),
    "9x11x48-3x3s(1,2)": (1, 9, 11, 48, 3, (1, 2), 1),
    "13x9x32-10x9": (1, 13, 9, 32, (10, 9), 1, (4, 4)),
    "13x9x48-10x3": (1, 13, 9, 48, (10, 3), 1, (4, 1)),
}
# output (zero point, qmin, qmax), cycled: u8 relu6-like, u8 clamp, s8, u8 full range
OUTPUTS = [(0, 0, 200), (3, 3, 255), (-5, -128, 127), (100, 0, 255)]


def build(source: Path, tmp: Path, flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The kernel (its object cached per source and flags, :func:`ukernel.driver_library`)
    and the driver as a shared library (``flags``: gcc's, default the kernel object's on this
    host)."""
    lib = ctypes.CDLL(str(ukernel.driver_library(source, DRIVER, tmp, flags)))
    lib.drive.restype = None
    return lib


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` copied to a 64-byte boundary, as IREE places its constants and buffers (the
    kernel's 512-bit loads of the weights would otherwise split across cache lines)."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def layer(spec, out, rng, *, wide=False, lut=False):
    """One depthwise layer: padded u8 input, packed weights, params and the numpy result.
    The kernel size, stride and padding of ``spec`` are one int for both axes or (rows,
    columns)."""
    n, h, w, c, k, s, p = spec
    (kh, kw), (sh, sw), (ph, pw) = (v if isinstance(v, tuple) else (v, v) for v in (k, s, p))
    hp, wp = h + 2 * ph, w + 2 * pw
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    zx = 7
    x = np.full((n, hp, wp, c), zx, np.uint8)
    x[:, ph:ph + h, pw:pw + w] = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    wv = rng.integers(-128, 128, (c, kh, kw), dtype=np.int8)
    bias = rng.integers(-3000, 3000, c).astype(np.int64) - zx * wv.reshape(c, -1).astype(
        np.int64).sum(1)
    real = rng.uniform(2e-3, 2e-2, c)
    m0 = np.asarray([int(round(r * 2.0 ** (30 - np.frexp(r)[1] + 1))) for r in real], np.int64)
    shift = np.asarray([31 - np.frexp(r)[1] for r in real], np.int64)
    shp = ukernel.ConvShape(n, hp, wp, c, c, kh, kw, sh, sw, 1, 1, oh, ow, depthwise=True)
    zout, qmin, qmax = out
    lo = -128 if qmax <= 127 else 0
    table = rng.integers(lo, lo + 256, 256).astype(np.int64) if lut else None
    params = ukernel.pack_params(shp, bias, m0, shift, zout, qmin, qmax,
                                 acc_bound=2**31 if wide else None, lut=table, lut_lo=lo)
    acc = np.zeros((n, oh, ow, c), np.int64)
    for i in range(kh):
        for j in range(kw):
            acc += x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw].astype(
                np.int64) * wv[:, i, j].astype(np.int64)
    t = (acc + bias) * m0
    ref = np.clip(((t + (np.int64(1) << (shift - 1))) >> shift) + zout, qmin, qmax)
    if lut:
        ref = table[ref - lo]
    ref = ref.astype(np.int64).astype(np.uint8)
    return dict(x=aligned(x), w=aligned(ukernel.pack_dw_weights(wv, (sh, sw))), p=params,
                shp=shp, ref=ref, macs=n * oh * ow * c * kh * kw)


def run(lib, L, reps):
    s = L["shp"]
    y = np.zeros(s.out_size, np.uint8)
    ns = (ctypes.c_double * reps)()
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.drive(ptr(L["x"]), ptr(L["w"]), ptr(L["p"]), ptr(y), ctypes.c_int64(s.blocks),
              ctypes.c_int64(s.chunks), ctypes.c_int64(s.n), ctypes.c_int(reps), ns)
    return y.reshape(L["ref"].shape), [v / 1e6 for v in ns]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", nargs="*", type=Path, default=[ukernel.SOURCE])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--wide", action="store_true", help="force the i64 (wide) epilogue")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp)) for s in args.source]
        print("| shape | epilogue | " + " | ".join(f"{s.name} ms (GOPS)" for s in args.source)
              + " |")
        print("|---" * (len(libs) + 2) + "|")
        for i, name in enumerate(args.shapes):
            L = layer(SHAPES[name], OUTPUTS[i % len(OUTPUTS)], rng, wide=args.wide)
            cells = []
            for lib in libs:
                y, t = run(lib, L, args.reps)
                ms = statistics.median(t)
                cells.append(f"{ms:.4f} ({2 * L['macs'] / ms / 1e6:.0f})"
                             + ("" if np.array_equal(y, L["ref"]) else " MISMATCH"))
            epi = "narrow" if L["p"][ukernel.H_NARROW] else "wide"
            print(f"| {name} | {epi} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

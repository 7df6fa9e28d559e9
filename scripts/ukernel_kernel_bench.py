#!/usr/bin/env python
"""The VNNI conv microkernel alone (no IREE): the C source built into a shared library with a
small driver that runs every workgroup of one layer on one thread, checked bit for bit against
numpy (qcompile's requantize), timed per layer (median ms and GOPS).

Usage: .venv/bin/python scripts/ukernel_kernel_bench.py [--source conv_vnni.c ...] [--shapes ...]

Several ``--source`` files are timed side by side (e.g. a kernel change against ``git show
HEAD:qcompile/codegen/ukernel/conv_vnni.c``)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qcompile.codegen import ukernel  # noqa: E402

DRIVER = r"""
#include <stdint.h>
#include <time.h>
typedef void (*entry)(const uint8_t*, int64_t, const int8_t*, int64_t, const int64_t*, int64_t,
                      const uint8_t*, int64_t, uint8_t*, int64_t, int64_t, int64_t, int64_t);
void qk_conv2d_u8s8(const uint8_t*, int64_t, const int8_t*, int64_t, const int64_t*, int64_t,
                    const uint8_t*, int64_t, uint8_t*, int64_t, int64_t, int64_t, int64_t);
void qk_wino_u8s8(const uint8_t*, int64_t, const int8_t*, int64_t, const int64_t*, int64_t,
                  const uint8_t*, int64_t, uint8_t*, int64_t, int64_t, int64_t, int64_t);
// ns of each of `reps` passes over every workgroup of the layer (wino: qk_wino_u8s8)
void drive(const uint8_t* x, const int8_t* w, const int64_t* p, const uint8_t* r, uint8_t* y,
           int64_t blocks, int64_t chunks, int64_t n, int reps, double* ns, int wino) {
  const entry run = wino ? qk_wino_u8s8 : qk_conv2d_u8s8;
  for (int i = 0; i < reps; ++i) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t k = 0; k < blocks; ++k)
          run(x, 0, w, 0, p, 0, r, 0, y, 0, k, c, b);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ns[i] = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
  }
}
"""

# name: (N, H, W, C, F, K, stride, pad, residual)
SHAPES = {
    "112x112x16-96-1x1": (1, 112, 112, 16, 96, 1, 1, 0, False),
    "112x112x32-16-1x1": (1, 112, 112, 32, 16, 1, 1, 0, False),
    "56x56x24-144-1x1": (1, 56, 56, 24, 144, 1, 1, 0, False),
    "56x56x144-24-1x1+res": (1, 56, 56, 144, 24, 1, 1, 0, True),
    # F = 24 and 8 as pixel pairs (ConvShape.pair): mobilenet_v2's 96 -> 24 projection, and
    # odd widths (a pair across a row's end) with padding and a residual
    "56x56x96-24-1x1": (1, 56, 56, 96, 24, 1, 1, 0, False),
    "7x9x20-24-3x3+res": (2, 7, 9, 20, 24, 3, 1, 1, True),
    "5x7x12-8-1x1": (1, 5, 7, 12, 8, 1, 1, 0, False),
    "28x28x32-192-1x1": (1, 28, 28, 32, 192, 1, 1, 0, False),
    "14x14x384-64-1x1": (1, 14, 14, 384, 64, 1, 1, 0, False),
    "7x7x960-160-1x1": (1, 7, 7, 960, 160, 1, 1, 0, False),
    "56x56x64-64-3x3": (1, 56, 56, 64, 64, 3, 1, 1, False),
    "56x56x64-64-3x3+res": (1, 56, 56, 64, 64, 3, 1, 1, True),
    "14x14x256-256-3x3": (1, 14, 14, 256, 256, 3, 1, 1, False),
    "28x28x128-128-3x3": (1, 28, 28, 128, 128, 3, 1, 1, False),
    # Winograd's edges: OH and OW no multiple of 4, two images, a residual
    "10x13x32-64-3x3+res": (2, 10, 13, 32, 64, 3, 1, 1, True),
    "7x7x256-128-3x3": (1, 7, 7, 256, 128, 3, 1, 1, False),
    "7x7x2048-512-1x1": (1, 7, 7, 2048, 512, 1, 1, 0, False),
    "224x224x3-64-7x7s2": (1, 224, 224, 3, 64, 7, 2, 3, False),
    "9x11x6-40-3x3s2+res": (2, 9, 11, 6, 40, 3, 2, 1, True),
    "8x8x20-37-1x1-shift": (1, 8, 8, 20, 37, 1, 1, 0, False),
    "28x28x64-64-3x3+res-shift31": (1, 28, 28, 64, 64, 3, 1, 1, True),
    "8x8x20-40-1x1-shift62": (1, 8, 8, 20, 40, 1, 1, 0, False),
    "28x28x32-64-1x1-shift30": (1, 28, 28, 32, 64, 1, 1, 0, False),
    "8x8x20-72-1x1-shift62": (1, 8, 8, 20, 72, 1, 1, 0, False),
    # blocks whose channels are all real: packed stores of 16 (F 80), 32 (F 96), 48 (F 112)
    "8x8x20-80-1x1": (1, 8, 8, 20, 80, 1, 1, 0, False),
    "8x8x20-96-1x1": (1, 8, 8, 20, 96, 1, 1, 0, False),
    "8x8x20-112-1x1+res": (1, 8, 8, 20, 112, 1, 1, 0, True),
    "112x112x3-32-3x3s2": (1, 224, 224, 3, 32, 3, 2, 1, False),
    # the unrolled 3x3 stem tiles (STEM3) of 32 and 64 channels, rows no multiple of 6
    "15x19x3-32-3x3s2": (2, 29, 37, 3, 32, 3, 2, 1, False),
    "15x19x3-64-3x3s2": (2, 29, 37, 3, 64, 3, 2, 1, False),
    # resnet50's expansion 1x1 convs with the block's residual (conv3), and without
    "56x56x64-256-1x1+res": (1, 56, 56, 64, 256, 1, 1, 0, True),
    "56x56x64-256-1x1": (1, 56, 56, 64, 256, 1, 1, 0, False),
    "28x28x128-512-1x1+res": (1, 28, 28, 128, 512, 1, 1, 0, True),
    "14x14x256-1024-1x1+res": (1, 14, 14, 256, 1024, 1, 1, 0, True),
    "7x7x512-2048-1x1+res": (1, 7, 7, 512, 2048, 1, 1, 0, True),
    # the same as the models have them: the residual's multiplier near 1 sets the shift to 31
    "56x56x64-256-1x1+res-near1": (1, 56, 56, 64, 256, 1, 1, 0, True),
    "28x28x128-512-1x1+res-near1": (1, 28, 28, 128, 512, 1, 1, 0, True),
    "56x56x144-24-1x1+res-near1": (1, 56, 56, 144, 24, 1, 1, 0, True),
    "56x56x64-64-3x3+res-near1": (1, 56, 56, 64, 64, 3, 1, 1, True),
    # MiniLM's linears at seq 128, batch 1 (M = 128 rows as a 1 x 128 image)
    "minilm-qkv-128x384-1152": (1, 1, 128, 384, 1152, 1, 1, 0, False),
    "minilm-ffn1-128x384-1536": (1, 1, 128, 384, 1536, 1, 1, 0, False),
    "minilm-ffn2-128x1536-384": (1, 1, 128, 1536, 384, 1, 1, 0, False),
}
# output (zero point, qmin, qmax), cycled over the shapes: s8, u8, s8 + relu, u8 + relu, u8 + clamp
OUTPUTS = [(-3, -128, 127), (100, 0, 255), (-10, -10, 127), (20, 20, 255), (5, 0, 200)]


def build(source: Path, tmp: Path, flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The kernel (its object cached per source and flags, :func:`ukernel.driver_library`)
    and the driver as a shared library (``flags``: gcc's, default the kernel object's on this
    host)."""
    lib = ctypes.CDLL(str(ukernel.driver_library(source, DRIVER, tmp, flags)))
    lib.drive.restype = None
    return lib


def layer(name, spec, out, rng, *, wide=False, lut=False, pairs=True, wino=False):
    n, h, w, c, f, k, s, p, res = spec
    cp = ukernel.padded_channels(c)
    hp, wp = h + 2 * p, w + 2 * p
    oh, ow = (hp - k) // s + 1, (wp - k) // s + 1
    zx = 7
    x = np.full((n, hp, wp, cp), zx, np.uint8)
    x[:, p:p + h, p:p + w, :c] = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    wv = np.zeros((f, k, k, cp), np.int8)
    wv[..., :c] = rng.integers(-127, 128, (f, k, k, c), dtype=np.int8)
    bias = rng.integers(-2000, 2000, f).astype(np.int64) - zx * wv.reshape(f, -1).astype(
        np.int64).sum(1)
    # real multipliers ~1e-3 (shift ~40); F = 37 has a small shift (< 32)
    real = rng.uniform(2e-4, 2e-3, f)
    m0 = np.asarray([int(round(r * 2.0 ** (30 - np.frexp(r)[1] + 1))) for r in real], np.int64)
    shift = np.asarray([31 - np.frexp(r)[1] for r in real], np.int64)
    if f == 37:   # a small shift
        shift = np.minimum(shift, 20)
    if name.endswith("shift31"):   # a residual term's multiplier sets the shift (narrow, k 30)
        shift = np.full(f, 31)
    if name.endswith("near1"):     # the same with the multipliers a real model has there
        m0 = m0 >> (shift - 31)    # (~2^21: the accumulator's real scale kept; narrow, k 30)
        shift = np.full(f, 31)
    if name.endswith("shift30"):   # narrow with k = 29, no residual
        shift = np.full(f, 30)
        m0 = np.minimum(m0, 2**20)
    if name.endswith("shift62"):   # narrow, but the zero point too large to fold at this shift
        shift = np.full(f, 62)
        m0 = np.full(f, 2**31 - 1)
    m1 = rng.integers(2**30, 2**31, f).astype(np.int64) if res else None
    zres = 5
    shp = ukernel.ConvShape(n, hp, wp, cp, f, k, k, s, s, 1, 1, oh, ow,
                            pair=pairs and ukernel.pairs_fit(f, speed=False))
    if wino:
        assert ukernel.wino_fits(shp, wv, speed=False) is None, ukernel.wino_fits(shp, wv, False)
        shp = replace(shp, wino=True)
    zout, qmin, qmax = out
    lo = -128 if qmax <= 127 else 0           # the output dtype's low end
    table = rng.integers(lo, lo + 256, 256).astype(np.int64) if lut else None
    params = ukernel.pack_params(shp, bias, m0, shift, zout, qmin, qmax, m1=m1, res_zp=zres,
                                 res_signed=False, acc_bound=2**31 if wide else None,
                                 lut=table, lut_lo=lo)
    r = rng.integers(0, 256, (n, oh, ow, f), dtype=np.uint8) if res else np.zeros(1, np.uint8)
    # numpy reference
    cols = np.stack([x[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :]
                     for i in range(k) for j in range(k)], axis=3)      # n oh ow kk cp
    acc = np.einsum("nyxkc,fkc->nyxf", cols.astype(np.int64),
                    wv.reshape(f, k * k, cp).astype(np.int64))
    t = (acc + bias) * m0
    if res:
        t = t + (r.astype(np.int64) - zres) * m1
    ref = np.clip(((t + (np.int64(1) << (shift - 1))) >> shift) + zout, qmin, qmax)
    if lut:
        ref = table[ref - lo]
    ref = ref.astype(np.int64).astype(np.uint8).view(np.int8)
    macs = n * oh * ow * f * k * k * c
    packed = ukernel.pack_wino_weights(wv, cp) if wino else ukernel.pack_weights(wv, shp.pair)
    return dict(x=x, w=packed, p=params, r=r, shp=shp, ref=ref,
                macs=macs)


def wino_shape(spec) -> bool:
    """Whether the Winograd entry takes this shape (:func:`ukernel.wino_fits`, the kernel's
    conditions) with random weights in [-127, 127], which pass the exact recovery's bound
    below C = 512."""
    n, h, w, c, f, k, s, p, res = spec
    shp = ukernel.ConvShape(n, h + 2 * p, w + 2 * p, ukernel.padded_channels(c), f, k, k, s, s,
                            1, 1, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
    zeros = np.zeros((f, k, k, c), np.int8)
    return c < 512 and ukernel.wino_fits(shp, zeros, speed=False) is None


def run(lib, L, reps):
    shp = L["shp"]
    y = np.zeros(shp.out_size, np.int8)
    ns = (ctypes.c_double * reps)()
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.drive(ptr(L["x"]), ptr(L["w"]), ptr(L["p"]), ptr(L["r"]), ptr(y),
              *(ctypes.c_int64(g) for g in shp.grid),
              ctypes.c_int(reps), ns, ctypes.c_int(int(shp.wino)))
    return y, [v / 1e6 for v in ns]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", nargs="*", type=Path, default=[ukernel.SOURCE])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--wide", action="store_true", help="force the i64 (wide) epilogue")
    ap.add_argument("--pairs", choices=("on", "off", "both"), default="on",
                    help="F = 8 or 24 as pixel pairs (ConvShape.pair); both: each such shape "
                    "twice, pairs off first")
    ap.add_argument("--wino", action="store_true",
                    help="each shape the Winograd entry takes (qk_wino_u8s8) a second time, "
                    "through it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp)) for s in args.source]
        print("| shape | " + " | ".join(f"{s.name} ms (GOPS)" for s in args.source) + " |")
        print("|---" * (len(libs) + 1) + "|")
        runs = []
        for i, name in enumerate(args.shapes):
            fits = ukernel.pairs_fit(SHAPES[name][4], speed=False)
            modes = [False, True] if args.pairs == "both" and fits else [args.pairs != "off"]
            runs += [(i, name, m, False) for m in modes]
            if args.wino and wino_shape(SHAPES[name]):
                runs.append((i, name, modes[-1], True))
        for i, name, pairs, wino in runs:
            L = layer(name, SHAPES[name], OUTPUTS[i % len(OUTPUTS)], np.random.default_rng(i),
                      wide=args.wide, pairs=pairs, wino=wino)
            name += " (pairs)" if L["shp"].pair else " (wino)" if wino else ""
            cells = []
            for lib in libs:
                y, t = run(lib, L, args.reps)
                exact = np.array_equal(y.reshape(L["ref"].shape), L["ref"])
                ms = statistics.median(t)
                cells.append(f"{ms:.4f} ({2 * L['macs'] / ms / 1e6:.0f})"
                             + ("" if exact else " MISMATCH"))
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

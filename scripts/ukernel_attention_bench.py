#!/usr/bin/env python
"""The fused attention kernel (``qk_attention_u8`` in conv_vnni.c) alone, no IREE: built into a
shared library with a small driver that runs every workgroup of one attention layer on one
thread, checked bit for bit against numpy (qcompile's reference semantics: the two matmuls, both
requantizes, the mask table and ``qmath.softmax_codes``), timed per layer (median ms).

Usage: .venv/bin/python scripts/ukernel_attention_bench.py [--source conv_vnni.c ...]
[--cases ...] [--reps N]"""

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
from qcompile.ir import qmath  # noqa: E402
from qcompile.ir.types import DType, QParams  # noqa: E402

DRIVER = r"""
#include <stdint.h>
#include <time.h>
void qk_attention_u8(const uint8_t*, int64_t, const uint8_t*, int64_t, const uint8_t*, int64_t,
                     const int64_t*, int64_t, const int64_t*, int64_t, uint8_t*, int64_t,
                     int64_t, int64_t, int64_t);
void drive(const uint8_t* q, const uint8_t* k, const uint8_t* v, const int64_t* m,
           const int64_t* p, uint8_t* y, int64_t heads, int64_t chunks, int64_t n, int reps,
           double* ns) {
  for (int i = 0; i < reps; ++i) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t h = 0; h < heads; ++h)
          qk_attention_u8(q, 0, k, 0, v, 0, m, 0, p, 0, y, 0, h, c, b);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ns[i] = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
  }
}
"""

# name: (N, S, H, D, q/k/v signed, mask images (0: none), shared mask)
CASES = {
    "minilm-b1-s128": (1, 128, 12, 32, False, 1),
    "minilm-b4-s128": (4, 128, 12, 32, False, 4),
    "bert-b1-s128-d64": (1, 128, 12, 64, False, 1),
    "odd-s37-d20-signed": (2, 37, 3, 20, True, 2),
    "s9-d4-nomask": (3, 9, 2, 4, False, 0),
    "s512-d32-shared-mask": (1, 512, 2, 32, True, 1),
    "s100-d128": (2, 100, 2, 128, False, 2),
}


def build(source: Path, tmp: Path, flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The kernel (its object cached per source and flags, :func:`ukernel.driver_library`)
    and the driver as a shared library (``flags``: gcc's, default the kernel object's on this
    host)."""
    lib = ctypes.CDLL(str(ukernel.driver_library(source, DRIVER, tmp, flags)))
    lib.drive.restype = None
    return lib


def _requant(acc: np.ndarray, row: tuple[int, ...]) -> np.ndarray:
    bias, m, sh, zp, lo, hi = row
    t = (acc.astype(np.int64) + bias) * m
    return np.clip(((t + (1 << (sh - 1))) >> sh) + zp, lo, hi)


def case(spec: tuple, rng: np.random.Generator, vbmi: bool | None = None) -> dict:
    """Random codes, mask and quantization parameters of one attention layer, its kernel
    params (``vbmi``: the byte-table lookups; default: where the host has them) and the numpy
    reference output."""
    n, s, h, d, signed, mask_n = spec
    dt = np.int8 if signed else np.uint8
    lo_in = -128 if signed else 0
    q, k, v = (rng.integers(lo_in, lo_in + 256, (n, s, h * d)).astype(dt) for _ in range(3))
    zq, zk, zv = (int(rng.integers(lo_in + 60, lo_in + 196)) for _ in range(3))
    mask = rng.integers(0, 2, (max(mask_n, 1), s)).astype(np.int64)
    mask[:, 0] = 1
    if mask_n:
        mask[0, s // 2:] = 0                            # a padded sequence
        mask[-1, -1] = 3                                # clamped to 2
    # scores onto u8 codes (shift >= 33: the 32-bit form; a small multiplier keeps codes apart)
    # (signed operands: s8 scores too)
    lo1 = -128 if signed else 0
    rq1 = (-int(rng.integers(-3, 4)), int(rng.integers(2**29, 2**31 - 1)), 40 + d // 64,
           120 + lo1, lo1, lo1 + 255)
    s_in = 0.08
    mask_table = np.stack([np.clip(np.arange(256) - 200 * (r < 2) - 30 * (r == 0) + 3 * r, 0,
                                   255) + lo1 for r in range(4)]).astype(np.int64)
    exp_table = qmath.softmax_table(QParams(DType.U8, (s_in,), (0,), 0, 255))
    sm = (qmath.softmax_multiplier(QParams(DType.U8, (1 / 255,), (0,), 0, 255)), 0, 0, 255)
    zp_p = 0
    rq2 = (-int(rng.integers(-5, 6)), int(rng.integers(2**29, 2**31 - 1)), 38, -3 if signed
           else 130, -128 if signed else 0, 127 if signed else 255)
    shape = ukernel.AttentionShape(n, s, h, d, mask_n)
    flips = (signed, not signed, not signed)
    zps = (zq + 128 * flips[0], zk - 128 * flips[1], zv - 128 * flips[2], zp_p)
    params = ukernel.pack_attention_params(shape, flips, zps, lo1, rq1, sm, rq2,
                                           mask_table if mask_n else None, exp_table,
                                           scores_signed=signed, vbmi=vbmi)
    # the reference
    qh = q.reshape(n, s, h, d).transpose(0, 2, 1, 3).astype(np.int64) - zq
    kh = k.reshape(n, s, h, d).transpose(0, 2, 1, 3).astype(np.int64) - zk
    vh = v.reshape(n, s, h, d).transpose(0, 2, 1, 3).astype(np.int64) - zv
    scores = _requant(qh @ kh.transpose(0, 1, 3, 2), rq1)
    if mask_n:
        rows = np.broadcast_to((np.clip(mask, -1, 2) + 1)[:, None, None, :], scores.shape)
        scores = mask_table[rows, scores - lo1]
    p = qmath.softmax_codes(scores, 3, exp_table, sm[0], sm[1], (sm[2], sm[3]))
    out = _requant((p - zp_p) @ vh, rq2).astype(dt)
    ref = out.transpose(0, 2, 1, 3).reshape(n, s, h * d)
    return dict(q=q, k=k, v=v, mask=mask, p=params, shape=shape, ref=ref)


def run(lib: ctypes.CDLL, c: dict, reps: int) -> tuple[np.ndarray, list[float]]:
    a = c["shape"]
    y = np.zeros(c["ref"].shape, c["ref"].dtype)
    ns = (ctypes.c_double * reps)()
    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.drive(ptr(c["q"]), ptr(c["k"]), ptr(c["v"]), ptr(c["mask"]), ptr(c["p"]), ptr(y),
              ctypes.c_int64(a.heads), ctypes.c_int64(a.chunks), ctypes.c_int64(a.n),
              ctypes.c_int(reps), ns)
    return y, [t / 1e6 for t in ns]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", nargs="*", type=Path, default=[ukernel.SOURCE])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--gather", action="store_true",
                    help="the vpgatherdd table lookups even where the host has AVX-512 VBMI")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp)) for s in args.source]
        print("| case | " + " | ".join(f"{s.name} ms" for s in args.source) + " |")
        print("|---" * (len(libs) + 1) + "|")
        for name in args.cases:
            c = case(CASES[name], rng, vbmi=False if args.gather else None)
            cells = []
            for lib in libs:
                y, t = run(lib, c, args.reps)
                exact = np.array_equal(y, c["ref"])
                cells.append(f"{statistics.median(t):.4f}" + ("" if exact else " MISMATCH"))
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

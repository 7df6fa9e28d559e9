#!/usr/bin/env python
"""The VNNI conv microkernel (qcompile/codegen/ukernel) against qcompile's stock conv lowering and
torch's oneDNN quantized conv, on resnet18's conv shapes: bit-exact check against the reference
interpreter, then median ms at 1 and 2 IREE worker threads.

Usage: .venv/bin/python scripts/ukernel_conv_bench.py [--shapes NAME ...] [--reps N] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qcompile.codegen import iree_cpu, ukernel  # noqa: E402
from qcompile.codegen.mlir_emit import emit_module  # noqa: E402
from qcompile.ir import qmath  # noqa: E402
from qcompile.ir.graph import Graph, Op, node  # noqa: E402
from qcompile.ir.types import DType, QParams  # noqa: E402
from qcompile.reference import interpreter  # noqa: E402

# name: (H, W, C, F, K, stride, pad, residual)
SHAPES = {
    "56x56x64-64-3x3s1": (56, 56, 64, 64, 3, 1, 1, False),
    "56x56x64-64-3x3s1+res": (56, 56, 64, 64, 3, 1, 1, True),
    "28x28x128-128-3x3s1": (28, 28, 128, 128, 3, 1, 1, False),
    "56x56x64-128-3x3s2": (56, 56, 64, 128, 3, 2, 1, False),
    "14x14x256-256-3x3s1": (14, 14, 256, 256, 3, 1, 1, False),
    "56x56x64-128-1x1s2": (56, 56, 64, 128, 1, 2, 0, False),
    "224x224x3-64-7x7s2": (224, 224, 3, 64, 7, 2, 3, False),
    # the rest of resnet18's convs, and resnet50 / mobilenet_v2 1x1 convs
    "28x28x128-256-3x3s2": (28, 28, 128, 256, 3, 2, 1, False),
    "14x14x256-512-3x3s2": (14, 14, 256, 512, 3, 2, 1, False),
    "7x7x512-512-3x3s1": (7, 7, 512, 512, 3, 1, 1, False),
    "7x7x512-512-3x3s1+res": (7, 7, 512, 512, 3, 1, 1, True),
    "14x14x256-512-1x1s2": (14, 14, 256, 512, 1, 2, 0, False),
    "56x56x64-256-1x1s1+res": (56, 56, 64, 256, 1, 1, 0, True),
    "56x56x256-64-1x1s1": (56, 56, 256, 64, 1, 1, 0, False),
    "14x14x1024-256-1x1s1": (14, 14, 1024, 256, 1, 1, 0, False),
    "7x7x512-2048-1x1s1+res": (7, 7, 512, 2048, 1, 1, 0, True),
    "7x7x2048-512-1x1s1": (7, 7, 2048, 512, 1, 1, 0, False),
    "56x56x24-144-1x1s1": (56, 56, 24, 144, 1, 1, 0, False),
    "14x14x384-64-1x1s1": (14, 14, 384, 64, 1, 1, 0, False),
    "7x7x960-160-1x1s1": (7, 7, 960, 160, 1, 1, 0, False),
    "7x7x320-1280-1x1s1": (7, 7, 320, 1280, 1, 1, 0, False),
}
# bit-exactness only (--check): odd channel counts (C not a multiple of 4, F not of 16/64),
# non-square inputs, padding without stride, 5x5
CHECKS = {
    "9x11x6-40-3x3s2+res": (9, 11, 6, 40, 3, 2, 1, True),
    "7x7x5-19-1x1s1": (7, 7, 5, 19, 1, 1, 0, False),
    "13x10x12-72-5x5s1p2+res": (13, 10, 12, 72, 5, 1, 2, True),
    "8x8x16-200-3x3s1p0": (8, 8, 16, 200, 3, 1, 0, False),
}


def qir_chain(h, w, c, f, k, s, p, residual, rng):
    """A one-conv QIR graph (NHWC): qconv2d → requant (relu folded into the clamp) [+ residual]."""
    x = node(Op.INPUT, DType.U8, (1, h, w, c), name="x")
    ins = [x]
    wv = rng.integers(-127, 128, (f, k, k, c), dtype=np.int8)
    bias = rng.integers(-20000, 20000, f).astype(np.int32)
    wn = node(Op.CONST, DType.I8, wv.shape, value=wv)
    bn = node(Op.CONST, DType.I32, bias.shape, value=bias)
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    conv = node(Op.QCONV2D, DType.I32, (1, oh, ow, f), x, wn, bn, stride=(s, s),
                padding=(p, p), dilation=(1, 1), groups=1, x_zp=7, layout="nhwc")
    out = QParams(DType.U8, (0.05,), (3,), 0, 255)
    reals = [list(rng.uniform(0.5, 2.0, f) / (k * k * c * 40.0))]
    zps = [0]
    srcs = [conv]
    if residual:
        r = node(Op.INPUT, DType.U8, (1, oh, ow, f), name="r")
        ins.append(r)
        srcs.append(r)
        reals.append([0.7] * f)
        zps.append(11)
    rq = qmath.make_requant(reals, zps, out, axis=3, qmin=3)   # relu: clamp at zp
    y = node(Op.REQUANT, DType.U8, (1, oh, ow, f), *srcs, rq=rq)
    return Graph("conv", tuple(ins), (y,)), wv, bias, rq, (oh, ow)


def ukernel_mlir(h, w, c, f, k, s, p, residual, wv, bias, rq, oh, ow, zp, obj):
    cp = ukernel.padded_channels(c)
    shp = ukernel.ConvShape(1, h + 2 * p, w + 2 * p, cp, f, k, k, s, s, 1, 1, oh, ow)
    packed = ukernel.pack_weights(wv)
    wsum = wv.reshape(f, -1).astype(np.int64).sum(1)
    folded = bias.astype(np.int64) - zp * wsum - rq.terms[0].zero_point
    m0 = np.asarray(rq.terms[0].multiplier, np.int64)
    kw = {}
    if residual:
        kw = dict(m1=np.asarray(rq.terms[1].multiplier, np.int64), res_zp=rq.terms[1].zero_point)
    params = ukernel.pack_params(shp, folded, m0, np.asarray(rq.shift), rq.zp_out, rq.qmin,
                                 rq.qmax, **kw)
    target = ukernel.host_target((*iree_cpu.TARGET_FLAGS, *iree_cpu.FAST_FLAGS))
    exe = ukernel.executable_mlir("qk_conv", obj, shp, params.size, packed.size, residual,
                                  target)
    nin = shp.hp * shp.wp * cp
    nout = oh * ow * f
    t_x, t_xp = f"tensor<1x{h}x{w}x{c}xi8>", f"tensor<1x{shp.hp}x{shp.wp}x{cp}xi8>"
    t_y, t_yf, t_xf = f"tensor<1x{oh}x{ow}x{f}xi8>", f"tensor<{nout}xi8>", f"tensor<{nin}xi8>"
    t_w, t_p = f"tensor<{packed.size}xi8>", f"tensor<{params.size}xi64>"
    rarg = f", %r: {t_y}" if residual else ""
    rflat = (f"    %rf = tensor.collapse_shape %r [[0, 1, 2, 3]] : {t_y} into {t_yf}\n"
             if residual else "")
    rop, rty = (", %rf", f", {t_yf}") if residual else ("", "")
    w_hex, p_hex = packed.tobytes().hex(), params.astype("<i8").tobytes().hex()
    return f"""module {{
{exe}
  func.func @main(%x: {t_x}{rarg}) -> {t_y} {{
    %zp = arith.constant {zp} : i8
    %xp = tensor.pad %x low[0, {p}, {p}, 0] high[0, {p}, {p}, {cp - c}] {{
    ^bb0(%i0: index, %i1: index, %i2: index, %i3: index):
      tensor.yield %zp : i8
    }} : {t_x} to {t_xp}
    %xf = tensor.collapse_shape %xp [[0, 1, 2, 3]] : {t_xp} into {t_xf}
{rflat}    %w = arith.constant dense<"0x{w_hex}"> : {t_w}
    %pr = arith.constant dense<"0x{p_hex}"> : {t_p}
    %yf = flow.dispatch @qk_conv::@x86::@conv(%xf, %w, %pr{rop})
        : ({t_xf}, {t_w}, {t_p}{rty}) -> {t_yf}
    %y = tensor.expand_shape %yf [[0, 1, 2, 3]] output_shape [1, {oh}, {ow}, {f}]
        : {t_yf} into {t_y}
    return %y : {t_y}
  }}
}}
"""


def compile_mlir(text: str, flags) -> bytes:
    got = iree_cpu.try_compile(text, (*iree_cpu.TARGET_FLAGS, *flags))
    if isinstance(got, str):
        raise RuntimeError(got[:3000])
    return got


def run_module(vmfb: bytes, inputs):
    return iree_cpu.Module(vmfb)(*inputs)[0]


def bench_vmfb(vmfb: bytes, inputs, threads: int, reps: int) -> list[float]:
    """Per-call ms from iree-benchmark-module (each repetition's mean), repetitions kept.

    ``threads`` 0: the local-sync driver (inline in the calling thread), CPU time: the one
    number that other jobs on a shared machine do not inflate."""
    import iree.runtime as rt
    bench = Path(rt.__file__).parent.parent / "_runtime_libs" / "iree-benchmark-module"
    with tempfile.TemporaryDirectory() as tmp:
        m = Path(tmp) / "m.vmfb"
        m.write_bytes(vmfb)
        args = [str(bench), f"--module={m}", "--function=main", "--device_allocator=caching",
                *(["--device=local-sync"] if threads == 0 else
                  ["--device=local-task", f"--task_topology_max_group_count={threads}"]),
                f"--benchmark_repetitions={reps}", "--benchmark_min_time=0.05s",
                "--benchmark_format=json"]
        for i, x in enumerate(inputs):
            p = Path(tmp) / f"in{i}.npy"
            np.save(p, x)
            args.append(f"--input=@{p}")
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    times = []
    for bm in json.loads(out)["benchmarks"]:
        if bm.get("run_type") == "iteration":
            scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0}[bm["time_unit"]]
            times.append(bm["cpu_time" if threads == 0 else "real_time"] * scale)
    return times


def onednn_ms(h, w, c, f, k, s, p, threads, reps):
    import torch
    torch.set_num_threads(max(threads, 1))
    clock = time.thread_time if threads == 0 else time.perf_counter
    torch.backends.quantized.engine = "onednn" if "onednn" in \
        torch.backends.quantized.supported_engines else "x86"
    x = torch.quantize_per_tensor(torch.rand(1, c, h, w), 0.02, 7, torch.quint8)
    x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.quantize_per_channel(torch.randn(f, c, k, k), torch.rand(f) * 0.02 + 0.01,
                                    torch.zeros(f, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.conv2d_prepack(wt, torch.randn(f), [s, s], [p, p], [1, 1], 1)
    fn = torch.ops.quantized.conv2d_relu
    for _ in range(5):
        fn(x, packed, 0.05, 3)
    res = []
    for _ in range(reps):
        n = 0
        t0 = clock()
        while True:
            fn(x, packed, 0.05, 3)
            n += 1
            if clock() - t0 > 0.05:
                break
        res.append((clock() - t0) / n * 1e3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="*", default=[0, 1, 2],
                    help="0 = one thread, CPU time (local-sync); N = N workers, wall time")
    ap.add_argument("--no-stock", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="bit-exactness on the CHECKS shapes too, no timing")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    obj = ukernel.build_object()
    rows = []
    names = args.shapes + (list(CHECKS) if args.check else [])
    for name in names:
        h, w, c, f, k, s, p, residual = {**SHAPES, **CHECKS}[name]
        rng = np.random.default_rng(0)
        g, wv, bias, rq, (oh, ow) = qir_chain(h, w, c, f, k, s, p, residual, rng)
        x = rng.integers(0, 256, (1, h, w, c), dtype=np.uint8)
        inputs = [x]
        if residual:
            inputs.append(rng.integers(0, 256, (1, oh, ow, f), dtype=np.uint8))
        want = interpreter.run(g, *inputs)[0]
        uk_vmfb = compile_mlir(ukernel_mlir(h, w, c, f, k, s, p, residual, wv, bias, rq, oh, ow,
                                            7, obj), iree_cpu.FAST_FLAGS)
        got = run_module(uk_vmfb, [a.view(np.int8) for a in inputs])
        exact = np.array_equal(got.view(np.uint8), want.view(np.uint8))
        mism = int((got.view(np.uint8) != want.view(np.uint8)).sum())
        stock_vmfb = None
        if not args.no_stock:
            text = emit_module(g).operation.get_asm()
            stock_vmfb = compile_mlir(text, iree_cpu.FAST_FLAGS)
            sgot = run_module(stock_vmfb, inputs)
            assert np.array_equal(sgot.view(np.uint8), want.view(np.uint8)), "stock mismatch"
        row = {"shape": name, "exact": exact, "mismatches": mism,
               "gop": 2 * oh * ow * k * k * c * f / 1e9}
        for t in ([] if args.check else args.threads):
            row[f"uk{t}"] = bench_vmfb(uk_vmfb, [a.view(np.int8) for a in inputs], t, args.reps)
            if stock_vmfb is not None:
                row[f"stock{t}"] = bench_vmfb(stock_vmfb, inputs, t, args.reps)
            if not args.no_torch:
                row[f"torch{t}"] = onednn_ms(h, w, c, f, k, s, p, t, args.reps)
        rows.append(row)
        print(fmt_row(row, args.threads), flush=True)
    print()
    print(table(rows, [] if args.check else args.threads))


def med(v):
    return statistics.median(v) if v else float("nan")


def spread(v):
    return (max(v) - min(v)) / med(v) * 100 if v else float("nan")


def fmt_row(row, threads):
    parts = [row["shape"], "exact" if row["exact"] else f"MISMATCH({row['mismatches']})"]
    for t in threads:
        for kind in ("uk", "stock", "torch"):
            v = row.get(f"{kind}{t}")
            if v:
                parts.append(f"{kind}{t}T={med(v):.3f}ms(±{spread(v):.0f}%)")
    return "  ".join(parts)


def table(rows, threads):
    head = ["shape", "exact"]
    for t in threads:
        head += [f"uk {t}T", f"stock {t}T", f"oneDNN {t}T", f"stock/uk {t}T", f"uk/oneDNN {t}T"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], "yes" if r["exact"] else "NO"]
        for t in threads:
            u, s, o = med(r.get(f"uk{t}", [])), med(r.get(f"stock{t}", [])), \
                med(r.get(f"torch{t}", []))
            cells += [f"{u:.3f} ±{spread(r.get(f'uk{t}', [])) / 2:.0f}%",
                      f"{s:.3f} ±{spread(r.get(f'stock{t}', [])) / 2:.0f}%",
                      f"{o:.3f} ±{spread(r.get(f'torch{t}', [])) / 2:.0f}%",
                      f"{s / u:.2f}x", f"{u / o:.2f}x"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()

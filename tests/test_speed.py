"""Speed regression: qcompile's cpu target against eager fp32, measured in this process (same
threads, rotating timing blocks), with a generous ratio so machine noise cannot flip it. The real
comparisons against every peer are `qcompile bench` / scripts/bench.py, never inside pytest."""

from __future__ import annotations

import torch

from qcompile import zoo
from qcompile.bench.latency import median_ms
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig, quantize

MIN_SPEEDUP_VS_EAGER_FP32 = 1.2     # measured 1.5-2x on 2 cores


def test_resnet18_cpu_int8_is_faster_than_eager_fp32_at_batch_1():
    m = zoo.build("resnet18")
    g = torch.Generator().manual_seed(0)
    calib = [(torch.randn(4, 3, 224, 224, generator=g),) for _ in range(2)]
    q = quantize(m.module, calib[0], calib, QuantizeConfig(quantizer="qcompile"))
    model = compile_cpu(q, CompileOptions(batch_sizes=(1,), analyze=False))
    x = calib[0][0][:1]
    best = 0.0
    for _ in range(3):      # best of three windows: a busy neighbour slows one window, not all
        t = median_ms({"cpu": lambda: model(x), "eager": lambda: m.module(x)}, warmup=1,
                      repeats=6, windows=2)
        best = max(best, t["eager"]["median"] / t["cpu"]["median"])
        if best >= MIN_SPEEDUP_VS_EAGER_FP32:
            break
    assert best >= MIN_SPEEDUP_VS_EAGER_FP32, f"cpu int8 only {best:.2f}x eager fp32"

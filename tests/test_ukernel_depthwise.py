"""The depthwise conv microkernel (``qk_dwconv_u8s8``): alone against numpy on every kernel
size, stride, channel block and epilogue it takes; through target cpu, bit-exact with the
reference interpreter on a small inverted-residual model at batch 1 and 4 with the report
counting its chains; and the depthwise convs it does not take, with the reason."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cpu_target import _assert_bit_exact
from torch import nn

from qcompile.codegen import ukernel
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig, quantize

needs_vbmi = pytest.mark.skipif(
    shutil.which("gcc") is None or not ukernel.host_has_vnni() or not ukernel.host_has_vbmi(),
    reason="needs gcc and an AVX-512 VNNI + VBMI host")

_spec = importlib.util.spec_from_file_location(
    "ukernel_dw_bench", Path(__file__).resolve().parent.parent / "scripts" /
    "ukernel_dw_bench.py")
dwbench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dwbench)


@needs_vbmi
@pytest.mark.parametrize("mode", ["narrow", "wide", "table"])
def test_depthwise_kernel__bit_exact_with_numpy(tmp_path, mode):
    """3×3, 4×4 and 5×5 (two tap groups sharing their operands), 7×7 (three tap groups),
    strides 1 and 2, with and without padding, channels in blocks of 32 and a last block of 16,
    widths no multiple of the step, odd output heights (stride 1 computes two rows at once: the
    last one alone), unequal strides and kernels of 10 × 9 and 10 × 3 (two rows, loop counts
    unknown); u8 and s8 outputs
    with clamps; the 32-bit lane epilogue, the i64 one forced, and a table after the
    requantize."""
    lib = dwbench.build(ukernel.SOURCE, tmp_path)
    rng = np.random.default_rng(3)
    names = ["9x11x48-3x3s2", "9x13x32-5x5", "9x13x48-5x5", "8x11x48-4x4",
             "5x7x16-3x3-nopad", "10x10x64-7x7",
             "11x9x80-5x5s2-pad1", "9x10x32-3x3s(2,1)", "9x11x48-3x3s(1,2)", "13x9x32-10x9",
             "13x9x48-10x3"]
    for i, name in enumerate(names):
        n, h, w, c, k, s, p = dwbench.SHAPES[name]
        spec = (n, h, w, c, k, s, p) if mode != "table" else (1, h, w, c, k, s, p)
        layer = dwbench.layer(spec, dwbench.OUTPUTS[i % len(dwbench.OUTPUTS)], rng,
                              wide=mode == "wide", lut=mode == "table")
        assert bool(layer["p"][ukernel.H_NARROW]) == (mode != "wide")
        y, _ = dwbench.run(lib, layer, 1)
        np.testing.assert_array_equal(y, layer["ref"], err_msg=name)


def test_depthwise_weights__packed_three_taps_per_dword_with_shifted_copies_at_stride_1():
    w = np.arange(1, 2 * 2 * 5 + 1, dtype=np.int8).reshape(2, 2, 5)    # C = 2, KH = 2, KW = 5
    assert ukernel.dw_copies(5, (1, 1)) == 3 and ukernel.dw_copies(3, (1, 1)) == 2
    assert ukernel.dw_copies(5, (2, 2)) == 1 and ukernel.dw_copies(3, (1, 2)) == 1
    # stride 1: [C/16][copy][KH][G][16][4], copy v each dword v bytes up
    packed = ukernel.pack_dw_weights(w).reshape(1, 3, 2, 2, 16, 4)
    np.testing.assert_array_equal(packed[0, 0, 1, 0, 1], [*w[1, 1, :3], 0])
    np.testing.assert_array_equal(packed[0, 0, 1, 1, 1], [*w[1, 1, 3:], 0, 0])
    np.testing.assert_array_equal(packed[0, 1, 1, 0, 1], [0, *w[1, 1, :3]])
    np.testing.assert_array_equal(packed[0, 2, 1, 0, 1], [0, 0, *w[1, 1, :2]])
    np.testing.assert_array_equal(packed[0, 2, 1, 1, 1], [0, 0, *w[1, 1, 3:]])
    assert not packed[0, :, :, :, 2:].any()                             # channels past C
    # other strides: the packed weights alone
    np.testing.assert_array_equal(ukernel.pack_dw_weights(w, (2, 2)), packed[0, 0].reshape(-1))


class InvertedResidual(nn.Module):
    """A stem, two expand → depthwise → project blocks (3×3 stride 1 with a residual, 5×5
    stride 2) and an 8-channel depthwise conv the kernel does not take."""

    def __init__(self) -> None:
        super().__init__()
        act = nn.ReLU6
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), act())
        self.b1 = nn.Sequential(nn.Conv2d(16, 48, 1), act(),
                                nn.Conv2d(48, 48, 3, 1, 1, groups=48), act(),
                                nn.Conv2d(48, 16, 1))
        self.b2 = nn.Sequential(nn.Conv2d(16, 32, 1), act(),
                                nn.Conv2d(32, 32, 5, 2, 2, groups=32), act(),
                                nn.Conv2d(32, 8, 1), act(),
                                nn.Conv2d(8, 8, 3, 1, 1, groups=8), act())
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.stem(x)
        y = y + self.b1(y)
        y = self.b2(y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


@needs_vbmi
def test_inverted_residual__depthwise_kernel_on_cpu_equals_reference():
    torch.manual_seed(0)
    model = InvertedResidual().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(4, 3, 19, 21, generator=g),) for _ in range(3)]
    q = quantize(model, batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    compiled = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False))
    _assert_bit_exact(compiled, batches[1][0])
    rep = compiled.report["compile"]["ukernel"]
    assert rep["depthwise"] == 2
    assert rep["stock"] == {"conv: depthwise conv of 8 channels (not a multiple of 16)": 1}
    assert {"b1.2", "b2.2"} <= {loc.split(" ")[1] for loc in rep["lowered"]}   # depthwise

"""Integer semantics and the reference interpreter against PT2E, on a table of chains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qcompile.accuracy.exactness import compare
from qcompile.frontend.quantize import quantize
from qcompile.ir import qmath
from qcompile.ir.types import DType, QParams
from qcompile.passes.residency import residency
from qcompile.reference.program import ReferenceProgram


def test_fixed_point_represents_reals():
    rng = np.random.default_rng(0)
    reals = rng.uniform(1e-6, 4.0, size=64)
    (mults,), shifts = qmath.fixed_point([reals])
    for r, m, s in zip(reals, mults, shifts, strict=True):
        assert 2**30 <= m < 2**31
        assert abs(m * 2.0**-s - r) <= r * 2**-30


def test_requantize_rounds_half_up_and_clamps():
    out = QParams(DType.U8, (1.0,), (10,), 0, 255)
    rq = qmath.make_requant([[0.5]], [0], out, axis=None)
    got = qmath.requantize(rq, np.array([1, 3, -1, -3, 1000, -1000]))
    np.testing.assert_array_equal(got, [11, 12, 10, 9, 255, 0])


def test_dequantize__pt2e_value_on_int8_codes_and_immune_to_fma_contraction():
    rng = np.random.default_rng(0)
    scales = np.concatenate([rng.uniform(1e-6, 4.0, 64), [2.0**-100, 0.1, 2.0**40]])
    qp = QParams(DType.I32, tuple(scales.astype(np.float32)), (3,) * scales.size, -(2**31),
                 2**31 - 1, axis=1)
    codes = rng.integers(-256, 256, (7, scales.size))
    got = qmath.dequantize_array(codes, qp)
    pt2e = (codes - 3).astype(np.float32) * scales.astype(np.float32)
    np.testing.assert_array_equal(got, pt2e)          # |q - zp| < 2^24: PT2E's float exactly
    # what a contracted multiply-add computes, fma(t, 2^-sh, x), rounds once; with an exact
    # product that is round(t * 2^-sh + x) = round(dequant + x), the reference's value
    m, p = qmath.scale_fixed(scales)
    acc = rng.integers(-(2**31), 2**31, (7, scales.size))
    t = ((acc - 3) * m).astype(np.float32)
    x = rng.standard_normal((7, scales.size)).astype(np.float32)
    fused = (t.astype(np.float64) * p.astype(np.float64) + x).astype(np.float32)  # t*p exact
    separate = qmath.dequantize_array(acc, qp) + x
    finite = np.isfinite(separate)
    np.testing.assert_array_equal(fused[finite], separate[finite])
    with pytest.raises(ValueError, match="outside"):
        qmath.scale_fixed(np.array([1e-35]))


def test_requantize_shared_shift_for_two_terms():
    out = QParams(DType.I8, (0.1,), (0,), -128, 127)
    rq = qmath.make_requant([[0.05 / 0.1], [0.2 / 0.1]], [0, 5], out, axis=None)
    got = qmath.requantize(rq, np.array([10]), np.array([7]))
    assert got[0] == round((10 * 0.05 + 2 * 0.2) / 0.1)


class Chain(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        groups = {"depthwise": 8, "grouped": 2}.get(kind, 1)
        stride = 2 if kind == "strided" else 1
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, stride=stride, padding=1, groups=groups)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 6)
        self.mix = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        k = self.kind
        if k == "add":
            z = self.bn(self.conv(y)) + y
        elif k == "add_relu":
            z = torch.relu(self.bn(self.conv(y)) + y)
        elif k == "relu6":
            z = nn.functional.relu6(self.conv(y))
        elif k == "hardswish":
            z = nn.functional.hardswish(self.conv(y))
        elif k == "cat":
            z = self.mix(torch.cat([torch.relu(self.conv(y)), y], dim=1))
        elif k == "maxpool":
            z = nn.functional.max_pool2d(self.conv(y), 2)
        elif k == "avgpool":
            z = nn.functional.avg_pool2d(torch.relu(self.conv(y)), 2)
        else:
            z = torch.relu(self.conv(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


KINDS = ["relu", "add", "add_relu", "relu6", "hardswish", "depthwise", "grouped", "strided",
         "cat", "maxpool", "avgpool"]


@pytest.mark.parametrize("kind", KINDS)
def test_chain_matches_pt2e(kind):
    torch.manual_seed(0)
    model = Chain(kind).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    q = quantize(model, batches[0], batches)
    program = ReferenceProgram(q)
    x = batches[1]
    result = compare(program.graph(4), q.module, x)
    assert result["within_one_step_fraction"] == 1.0
    assert result["exact_fraction"] > 0.99
    got, want = program(*x), q(*x)
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    assert residency(program.graph(4))["chain_count"] >= 2


def test_reference_runs_several_batch_sizes(tiny_cnn, tiny_batches):
    q = quantize(tiny_cnn, tiny_batches[0], tiny_batches)
    program = ReferenceProgram(q)
    for batch in (1, 3):
        x = torch.randn(batch, 3, 16, 16)
        assert torch.allclose(program(x), q(x), atol=0.05)

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

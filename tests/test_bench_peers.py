"""The ONNX Runtime peers of `qcompile bench` (static QDQ and dynamic int8) are built from the
same model and calibration data and compute the model: their outputs track the float model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qcompile.bench import peers


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("name", ["ort_int8", "ort_int8_dynamic"])
def test_ort_int8_peers__track_the_float_model(name, tmp_path):
    torch.manual_seed(0)
    model = _Mlp().eval()
    calib = [(torch.randn(8, 32),) for _ in range(4)]
    ctx = peers.Context(model, None, calib, (8,), ("x",), tmp_path)
    run = peers.BUILDERS[name](ctx)
    x = torch.randn(8, 32)
    got = run(x)[0]                             # session outputs, in order
    want = model(x).detach().numpy()
    cos = (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)
    assert got.shape == want.shape and cos > 0.99, cos
    assert (tmp_path / ("model_int8.onnx" if name == "ort_int8" else
                        "model_int8_dynamic.onnx")).exists()

"""The ONNX Runtime peers of `qcompile bench` (static QDQ and dynamic int8) are built from the
same model and calibration data and compute the model: their outputs track the float model's."""

from __future__ import annotations

from pathlib import Path

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


def test_bench_run__reports_and_leaves_no_files_behind(tmp_path, monkeypatch):
    from qcompile.bench.suite import run_bench
    from qcompile.recipe import load_recipe

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "digits_cnn.yaml")
    report = run_bench(recipe, peers=["ort_int8"], batch_sizes=[1], repeats=3, warmup=1,
                       quiet_wait_s=0, profile=False, progress=False)
    assert report["engines"]["ort_int8"]["status"] == "ok"
    assert report["engines"]["qcompile"]["status"] == "ok"
    assert report["summary"]["batch_1"]["best_int8_peer"] == "ort_int8"
    assert list(scratch.iterdir()) == []        # the ONNX files went with the run

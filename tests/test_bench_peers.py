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


def test_bench_row__a_moving_ceiling_probe_flags_every_cell_noisy():
    from qcompile.bench.suite import CEILING, _batch_row, render_markdown

    def cell(median, p10, p90):
        return {"median": median, "p10": p10, "p90": p90}

    steady = {"qcompile": cell(1.0, 0.98, 1.05), "ort_int8": cell(2.0, 1.9, 2.1),
              CEILING: cell(2.7, 2.65, 2.8)}
    row = _batch_row(1, steady, load=0.2, qc=None)
    assert not row["host_unsteady"] and not any(c["noisy"] for c in row["ms"].values())
    assert CEILING not in row["ms"] and row["qcompile_speedup_vs"] == {"ort_int8": 2.0}
    lo, hi = row["int8_ceiling_range_gops"]
    assert lo < row["int8_ceiling_gops"] < hi          # p90 time is the low end of the range

    # the engines' own spreads are fine; only the probe shows the busy host
    busy = steady | {CEILING: cell(3.5, 2.7, 5.4)}
    row = _batch_row(8, busy, load=0.2, qc=None)
    assert row["host_unsteady"] and all(c["noisy"] for c in row["ms"].values())
    report = {"recipe": "r", "cores": 2, "threads": 2, "batches": [row], "engines": {}}
    assert "the host was busy" in render_markdown(report)

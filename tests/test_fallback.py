"""Fusion-aware accuracy fallback: on a model with a deliberately sensitive layer the full-int8
model misses the recipe's SQNR threshold; the search keeps the one chain that matters in float,
the threshold then holds, and the report names it with the estimated and measured speed paid."""

from __future__ import annotations

import json

import torch
from torch import nn
from typer.testing import CliRunner

from qcompile.cli import app
from qcompile.fallback import Trial, _choose, search, shortfall
from qcompile.recipe import load_recipe


class Sensitive(nn.Module):
    """conv2 writes one channel far above the others (per-tensor activation quantization crushes
    the rest); conv3, which reads them, is the chain to keep in float."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.conv2.bias[0] = 300.0
            self.conv3.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y))
        y = torch.relu(self.conv3(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def sensitive_model() -> nn.Module:
    return Sensitive().eval()


RECIPE = """\
version: 1
name: sensitive
model: {entry: "test_fallback:sensitive_model", input_shapes: [[1, 3, 12, 12]]}
quantizer: {kind: qcompile}
calibration: {dataset: random, batches: 3, batch_size: 8}
evaluation: {dataset: random, batch_size: 8, batches: 2}
targets: [reference]
accuracy: {min_sqnr_db: 30.0}
"""


def _recipe(tmp_path):
    path = tmp_path / "sensitive.yaml"
    path.write_text(RECIPE)
    return path


def test_fallback__keeps_the_sensitive_chain_in_float_and_reports_the_cost(tmp_path):
    r = search(load_recipe(_recipe(tmp_path)))
    assert not r["before"]["passed"] and r["before"]["failed"] == ["min_sqnr_db"]
    assert r["passed"] and r["kept_in_float"] == ["conv3"]
    assert r["after"]["sqnr_db"] > 30 > r["before"]["sqnr_db"]
    assert r["candidates"][0] == "conv3"                  # ranked by the attribution
    tried = {t["kept_in_float"][-1]: t for t in r["rounds"][0]["tried"]}
    assert set(tried) == {"conv1", "conv2", "conv3", "fc"}
    assert not tried["conv2"]["passed"]                   # the layer that makes the outlier
    # a float conv costs more than its int8 chain: fusion-aware estimate and measured latency
    assert r["after"]["estimated_cost"] > 1.0
    lat = r["latency_ms"]      # on cpu, or on ort saying why not on cpu (a float conv)
    assert lat["target"] == "cpu" or "cpu" in lat["not_on"]
    assert lat["fallback"]["median"] > 0 and lat["slowdown"] > 0


def test_fallback__already_passing_recipe_keeps_everything_int8(tmp_path):
    path = tmp_path / "easy.yaml"
    path.write_text(RECIPE.replace("min_sqnr_db: 30.0", "min_sqnr_db: 10.0"))
    r = search(load_recipe(path))
    assert r["passed"] and r["kept_in_float"] == [] and r["rounds"] == [] and r["trials"] == 1


def _trial(name: str, passed: bool, cost: float, short: float):
    from qcompile.accuracy.thresholds import Check

    return Trial((name,), {"sqnr_db": 0.0}, [Check("min_sqnr_db", 30.0, 0.0, passed)], cost,
                 short, None)  # type: ignore[arg-type]


def test_choose__cheapest_passing_else_most_shortfall_per_cost():
    current = _trial("none", False, 100.0, 1.0)
    cheap, dear = _trial("a", True, 150.0, 0.0), _trial("b", True, 120.0, 0.0)
    assert _choose(current, [cheap, dear, _trial("c", False, 101.0, 0.9)]) is dear
    # none passes: 0.5 shortfall for 100 cost beats 0.6 for 400
    small, big = _trial("d", False, 200.0, 0.5), _trial("e", False, 500.0, 0.4)
    assert _choose(current, [small, big]) is small
    assert _choose(current, [_trial("f", False, 110.0, 1.2)]) is None   # nothing improves


def test_shortfall__relative_to_each_threshold():
    from qcompile.accuracy.thresholds import Check

    checks = [Check("min_sqnr_db", 30.0, 15.0, False), Check("max_abs_error", 0.5, 1.0, False),
              Check("min_cosine", 0.99, 0.999, True)]
    assert shortfall(checks) == 0.5 + 1.0


def test_cli_fallback__prints_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["fallback", str(_recipe(tmp_path)), "--out", str(out),
                                      "--measure-on", "none"])
    assert result.exit_code == 0, result.output
    assert "kept in float: conv3; thresholds hold" in result.output
    saved = json.loads((out / "fallback.json").read_text())
    assert saved["kept_in_float"] == ["conv3"]

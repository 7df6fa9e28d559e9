"""Every shipped recipe as an accuracy regression test (PT2E int8 vs float, recipe thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qcompile.pipeline import run_recipe
from qcompile.recipe import load_recipe

RECIPES = Path(__file__).parent.parent / "recipes"
FAST = ["digits_cnn", "mlp", "resnet18", "mobilenet_v2", "efficientnet_lite0", "minilm"]
SLOW = ["resnet50", "bert_encoder"]


def _run(name: str) -> dict:
    # the cpu target has its own end-to-end tests (tests/test_recipes_cpu.py)
    report = run_recipe(load_recipe(RECIPES / f"{name}.yaml"), targets=["reference", "pt2e"])
    assert report["targets"]["pt2e"]["status"] == "ok"
    assert report["target"] == "reference", report["targets"]["reference"]
    vs_pt2e = report["exactness"]["vs_pt2e"]
    if vs_pt2e["within_one_step_fraction"] is not None:   # None: no int8 node to compare
        assert vs_pt2e["within_one_step_fraction"] == 1.0, vs_pt2e["worst"]
    failed = [c for c in report["accuracy"]["checks"] if not c["passed"]]
    assert report["accuracy"]["passed"], failed
    return report


@pytest.mark.parametrize("name", FAST)
def test_recipe_meets_thresholds(name):
    report = _run(name)
    assert sum(report["quantization"]["quantized_ops"].values()) > 0
    if name == "digits_cnn":
        assert report["accuracy"]["float"]["accuracy"] >= 0.97
        assert report["accuracy"]["int8"]["accuracy"] >= 0.97
    if name == "efficientnet_lite0":
        pt2e = report["targets"]["pt2e"]["accuracy"]["compare"]
        assert pt2e["top1_agreement"] >= 0.90
    if name == "minilm":
        assert report["evaluation"]["samples"] >= 200
        assert report["accuracy"]["compare"]["cosine"] >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_recipe_meets_thresholds(name):
    _run(name)

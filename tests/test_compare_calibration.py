"""scripts/compare_calibration.py: one row per calibration method, measured by real runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from qcompile.errors import RecipeError
from qcompile.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "recipes" / "digits_cnn.yaml"
SMALL = {"calibration.batches": 2, "calibration.batch_size": 16}


def _script():
    spec = importlib.util.spec_from_file_location(
        "compare_calibration", ROOT / "scripts" / "compare_calibration.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def compared(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = ["--recipes", str(DIGITS), "--methods", "minmax", "percentile", "--targets",
            "reference", "--set", "calibration.batches=2", "--set", "calibration.batch_size=16",
            "--no-warmup", "--out", str(out)]
    return script.main(argv), out


def test_compare__one_measured_row_per_method(compared):
    result, _ = compared
    rows = result["rows"]
    assert [r["method"] for r in rows] == ["minmax", "percentile"]   # the report's own record
    assert rows[1]["method_options"] == {"percentile": 99.99, "bins": 2048}
    for r in rows:
        assert r["calibration"] == {"dataset": "digits", "batches": 2, "samples": 32}
        assert r["quantize_s"] > 0
        ref = r["targets"]["reference"]
        assert ref["status"] == "ok" and ref["passed"] is True
        assert 0.9 <= ref["compare"]["top1_agreement"] <= 1.0
        assert 20.0 < ref["compare"]["sqnr_db"] < 200.0
        assert {c["key"] for c in ref["checks"]} >= {"min_sqnr_db", "min_top1_agreement"}
        assert "accuracy" in ref["int8"]
    # different ranges: the int8 outputs differ (min-max keeps the outliers, percentile clips)
    a, b = (r["targets"]["reference"]["compare"] for r in rows)
    assert (a["sqnr_db"], a["max_abs"]) != (b["sqnr_db"], b["max_abs"])


def test_compare__writes_json_and_markdown(compared):
    result, out = compared
    assert json.loads((out / "calibration_compare.json").read_text())["rows"] == result["rows"]
    md = (out / "calibration_compare.md").read_text()
    assert "| minmax |" in md and "| percentile (percentile=99.99, bins=2048) |" in md
    assert "reference SQNR dB" in md and "reference thresholds" in md


def test_variant__switching_method_drops_the_old_method_options(script):
    recipe = load_recipe(DIGITS)
    v = script.variant(recipe, "percentile", {"calibration.method_options": {"percentile": 99.9}})
    assert v.calibration.method == "percentile"
    assert v.calibration.method_options == {"percentile": 99.9}
    assert script.variant(recipe, "minmax", SMALL).calibration.batches == 2


def test_compare__unknown_method_is_a_recipe_error_before_any_run(script, tmp_path):
    with pytest.raises(RecipeError, match=r"unknown calibration method 'kl'(.|\n)*valid "
                                          r"methods: minmax, moving_average, histogram"):
        script.compare([DIGITS], ["minmax", "kl"], targets=["reference"], out=tmp_path)
    assert not list(tmp_path.iterdir())

"""The command line: run/check write reports, errors print one message and exit non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qcompile.cli import app

RECIPES = Path(__file__).parent.parent / "recipes"
runner = CliRunner()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    result = runner.invoke(app, ["run", str(RECIPES / "digits_cnn.yaml"), "--out", str(out),
                                 "-t", "pt2e", "-t", "cpu"])
    return result, out


def test_run_writes_report_with_stable_keys(digits_run):
    result, out = digits_run
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    for key in ("recipe", "model", "target", "versions", "quantization", "accuracy", "targets"):
        assert key in report
    assert report["target"] == "pt2e"
    assert report["quantization"]["quantized_ops"]["conv2d"] >= 2
    assert {"sqnr_db", "cosine", "max_abs", "top1_agreement"} <= set(
        report["accuracy"]["compare"])
    assert report["accuracy"]["passed"] is True
    assert (out / "report.md").read_text().startswith("# qcompile report: digits_cnn")


def test_run_reports_cpu_exactness_kernels_and_latency(digits_run):
    result, out = digits_run
    cpu = json.loads((out / "report.json").read_text())["targets"]["cpu"]
    assert cpu["status"] == "ok" and cpu["accuracy"]["passed"]
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0
    assert cpu["exactness"]["vs_reference"]["total"] > 0
    assert cpu["kernels"]["max_per_chain"] == 1
    lat = cpu["latency_ms"]
    assert lat["cpu"] > 0 and lat["eager_fp32"] > 0 and lat["batch"] == 1
    assert set(lat["per_batch"]) == {"1", "64"}
    assert "cpu" in result.output and "latency" in result.output


def test_unavailable_target_is_reported_not_hidden(tmp_path):
    path = _recipe(tmp_path, calibration__batches=1)
    result = runner.invoke(app, ["run", str(path), "-t", "pt2e", "-t", "cuda", "--out",
                                 str(tmp_path / "o")])
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["targets"]["cuda"]["status"] == "unavailable"
    assert report["targets"]["cuda"]["reason"]
    assert "cuda       unavailable" in result.output


def _recipe(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((RECIPES / "digits_cnn.yaml").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data[section][key] = value
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_fails_with_exit_1_on_missed_threshold(tmp_path):
    path = _recipe(tmp_path, accuracy__min_sqnr_db=150.0, calibration__batches=2)
    result = runner.invoke(app, ["check", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "accuracy check failed" in result.output and "min_sqnr_db" in result.output


def test_check_fails_when_no_target_ran(tmp_path):
    path = _recipe(tmp_path, calibration__batches=1)
    result = runner.invoke(app, ["check", str(path), "-t", "cuda", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "ran on no target" in result.output


def test_bad_recipe_is_one_message_no_traceback(tmp_path):
    path = _recipe(tmp_path, calibration__methd="minmax")
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    assert "qcompile: error: recipe" in result.output and "calibration.methd" in result.output
    assert "Traceback" not in result.output


def test_missing_recipe_file(tmp_path):
    result = runner.invoke(app, ["run", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "recipe file not found" in result.output


def test_unknown_target_option(tmp_path):
    result = runner.invoke(app, ["run", str(RECIPES / "digits_cnn.yaml"), "-t", "tpu"])
    assert result.exit_code == 2 and "unknown target 'tpu'" in result.output


def test_models_lists_the_zoo():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and "efficientnet_lite0" in result.output


def test_inspect_shows_chains_residency_and_dumps_ir(tmp_path):
    result = runner.invoke(app, ["inspect", str(RECIPES / "digits_cnn.yaml"), "--dump-ir",
                                 str(tmp_path / "ir")])
    assert result.exit_code == 0, result.output
    assert "int8 bytes fraction 1.0000" in result.output
    assert "chain  qconv2d+requant" in result.output
    assert (tmp_path / "ir" / "00-import.qir").is_file()


def test_inspect_kernels_shows_dispatches_per_chain():
    result = runner.invoke(app, ["inspect", str(RECIPES / "digits_cnn.yaml"), "--kernels",
                                 "--batch", "4"])
    assert result.exit_code == 0, result.output
    assert "cpu dispatches (batch 4)" in result.output
    assert "max 1 dispatch(es) per chain; 0 dispatch(es) write i32" in result.output
    assert "1 dispatch  qconv2d+requant" in result.output

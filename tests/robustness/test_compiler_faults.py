"""Compiler faults: an IREE failure leaves the MLIR where ``compile.keep_dir`` says and a
one-screen message with the exact command that reproduces it; float ops follow the recipe's
``float_ops`` policy (explicit, reported fallback — or a clear error)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import robustness_tally as tally
from robustness_models import block_recipe
from typer.testing import CliRunner

from qcompile.cli import app
from qcompile.codegen import iree_cpu

cli = CliRunner()
BAD_FLAG = "--iree-no-such-flag"


@pytest.fixture
def broken_iree(monkeypatch):  # type: ignore[no-untyped-def]
    """Every rung of the workaround ladder fails: the fast flags are a flag iree-compile does
    not know, and there are no workarounds."""
    monkeypatch.setattr(iree_cpu, "FAST_FLAGS", (BAD_FLAG,))
    monkeypatch.setattr(iree_cpu, "WORKAROUNDS", ())


def _recipe(folder: Path, extra: str, **kw: str) -> Path:
    path = folder / "block.yaml"
    path.write_text(block_recipe(extra, **kw), encoding="utf-8")
    return path


def _reproduce_command(message: str) -> list[str]:
    m = re.search(r"reproduce with: (.+)", message)
    assert m, message
    return shlex.split(m.group(1))


def _assert_one_screen(message: str) -> None:
    lines = message.strip().splitlines()
    assert len(lines) <= 30, f"{len(lines)} lines"
    assert "Traceback" not in message


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    """``qcompile run --target cpu`` with IREE failing; keep_dir outside the output folder."""
    folder = tmp_path_factory.mktemp("fault")
    mp = pytest.MonkeyPatch()
    mp.setattr(iree_cpu, "FAST_FLAGS", (BAD_FLAG,))
    mp.setattr(iree_cpu, "WORKAROUNDS", ())
    try:
        recipe = _recipe(folder, f"compile: {{batch_sizes: [1], keep_dir: '{folder / 'ir'}'}}\n")
        result = cli.invoke(app, ["run", str(recipe), "--target", "cpu", "--out",
                                  str(folder / "out"), "-q"])
    finally:
        mp.undo()
    return folder, result


def test_iree_failure__run_saves_mlir_in_keep_dir_and_prints_the_command(failed_run):
    folder, result = failed_run
    assert not isinstance(result.exception, Exception) or isinstance(result.exception,
                                                                      SystemExit), \
        result.exception
    saved = sorted((folder / "ir").glob("*.failed.mlir"))
    assert len(saved) == 1, sorted((folder / "ir").iterdir())
    assert "func.func @main" in saved[0].read_text()
    assert f"at:   {saved[0]}" in result.output
    _assert_one_screen(result.output.split("wrote ")[0])
    argv = _reproduce_command(result.output)
    assert Path(argv[0]).name == "iree-compile" and str(saved[0]) in argv and BAD_FLAG in argv
    report = json.loads((folder / "out" / "report.json").read_text())
    cpu = report["targets"]["cpu"]
    assert cpu["status"] == "failed" and "reproduce with:" in cpu["reason"]
    tally.case("compiler-fault cases", "iree-failure-run")


def test_iree_failure__the_printed_command_reproduces_it_and_the_mlir_is_whole(failed_run,
                                                                               tmp_path):
    _, result = failed_run
    argv = _reproduce_command(result.output)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and BAD_FLAG in proc.stderr
    fixed = [a for a in argv if a != BAD_FLAG]
    fixed[fixed.index("-o") + 1] = str(tmp_path / "m.vmfb")
    proc = subprocess.run(fixed, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tally.case("compiler-fault cases", "reproduce-command")


def test_iree_failure__run_exits_non_zero(failed_run):
    _, result = failed_run
    assert result.exit_code != 0


def test_iree_failure__mlir_lands_in_the_output_folder_by_default(tmp_path, broken_iree,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, "compile: {batch_sizes: [1]}\n")
    cli.invoke(app, ["run", str(recipe), "--target", "cpu", "--out", str(tmp_path / "out"),
                     "-q"])
    assert list((tmp_path / "out").glob("*.failed.mlir"))


def test_iree_failure__compile_exits_2_and_writes_no_artifact(tmp_path, broken_iree):
    keep = tmp_path / "ir"
    recipe = _recipe(tmp_path, f"compile: {{batch_sizes: [1], keep_dir: '{keep}'}}\n")
    out = tmp_path / "out" / "block.qca"
    result = cli.invoke(app, ["compile", str(recipe), "-o", str(out), "-q"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.output.startswith("qcompile: error: iree-compile failed for target cpu")
    _assert_one_screen(result.output)
    assert str(next(keep.glob("*.failed.mlir"))) in result.output
    assert not out.exists() and not (tmp_path / "out").exists()
    tally.case("compiler-fault cases", "iree-failure-compile")


def test_float_op__error_policy_is_a_clear_error(tmp_path):
    recipe = _recipe(tmp_path, "compile: {batch_sizes: [1], float_ops: error}\n").read_text()
    recipe = recipe.replace("robustness_models:block", "robustness_models:float_island")
    (tmp_path / "island.yaml").write_text(recipe)
    out = tmp_path / "out" / "m.qca"
    result = cli.invoke(app, ["compile", str(tmp_path / "island.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "float op 'div' survived integer lowering" in result.output
    assert re.search(r"at: +robustness_models\.py:\d+ div", result.output)
    assert "float_ops" in result.output and not out.exists()
    tally.case("compiler-fault cases", "float-op-error-policy")


def test_float_op__fallback_policy_runs_and_reports_it(tmp_path):
    recipe = _recipe(tmp_path, "compile: {batch_sizes: [1, 4]}\n").read_text()
    recipe = recipe.replace("robustness_models:block", "robustness_models:float_island")
    (tmp_path / "island.yaml").write_text(recipe)
    result = cli.invoke(app, ["run", str(tmp_path / "island.yaml"), "--target", "cpu",
                              "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    cpu = json.loads((tmp_path / "out" / "report.json").read_text())["targets"]["cpu"]
    assert cpu["status"] == "ok", cpu.get("reason")
    floats = cpu["residency"]["float_ops"]
    assert [f["op"] for f in floats if f["region"] == "inside"] == ["div"], floats
    assert "no rule rewrites it into an int8 chain" in floats[0]["reason"]
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0
    tally.case("compiler-fault cases", "float-op-fallback-policy")

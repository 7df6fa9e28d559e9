"""Compiler faults of target cuda: a Triton failure (ahead of time, at a kernel's first launch on
a GPU, or inside a kernel in the interpreter) is a one-screen ``CompileError`` that names the
kernel, its chain and source location, and leaves a reproducer JSON whose printed command reruns
exactly that ``triton.compile`` (:mod:`qcompile.codegen.triton.repro`). No GPU is needed: the
first-launch path runs a stand-in kernels module that raises what Triton's launcher raises."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import robustness_tally as tally
import torch
from robustness_models import block_inputs, block_recipe
from typer.testing import CliRunner

from qcompile.cli import app
from qcompile.codegen.triton import aot, loader, repro
from qcompile.codegen.triton import lower as triton_lower
from qcompile.codegen.triton.lower import lower_graph
from qcompile.codegen.triton.program import Program, Step
from qcompile.codegen.triton.target import first_launches
from qcompile.errors import CompileError
from qcompile.reference.program import lower

pytest.importorskip("triton")
CPU = torch.device("cpu")
CASE = "compiler-fault cases"


@pytest.fixture(scope="module")
def graph(quantized):  # type: ignore[no-untyped-def]
    return lower(quantized, 1).graph


@pytest.fixture(scope="module")
def quant_step(graph) -> Step:  # type: ignore[no-untyped-def]
    """The first launch of the block model (``quantize`` of its input), compiled kernels."""
    step = lower_graph(graph, loader.kernels(False), CPU).launches()[0]
    assert step.launch is not None and step.launch.kernel == "quantize"
    return step


def _block(step: Step, block: int) -> Step:
    assert step.launch is not None
    return replace(step, launch=replace(step.launch, consts={**step.launch.consts,
                                                             "BLOCK": block}))


def _command(message: str) -> list[str]:
    m = re.search(r" with: (.+)$", message, re.MULTILINE)
    assert m, message
    argv = shlex.split(m.group(1))
    assert argv[1:3] == ["-m", "qcompile.codegen.triton.repro"], argv
    return argv


def _rerun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def _assert_one_screen(message: str) -> None:
    assert len(message.strip().splitlines()) <= 30, message
    assert "Traceback" not in message


def _saved(folder: Path) -> tuple[Path, dict]:
    (path,) = folder.glob("triton.quantize.sm*.failed.json")
    return path, json.loads(path.read_text())


def test_aot_triton_error__reproducer_saved_and_its_command_still_fails(quant_step, tmp_path,
                                                                        triton_cache):
    bad = _block(quant_step, 100)                       # tl.arange needs a power of 2
    with pytest.raises(CompileError, match=r"^triton could not compile kernel 'quantize' "
                                           r"\(chain quant\) for sm_80\n") as info:
        aot.compile_step(bad, 80, keep_dir=str(tmp_path / "ir"))
    message = str(info.value)
    _assert_one_screen(message)
    assert f"at:   {bad.loc}" in message and "power of 2" in message
    path, doc = _saved(tmp_path / "ir")
    assert doc["kernel"] == "quantize" and doc["step"] == "quant" and doc["loc"] == bad.loc
    assert doc["constexprs"] == {"BLOCK": 100} and doc["target"]["arch"] == 80
    assert (doc["num_warps"], doc["num_stages"]) == (bad.launch.warps, bad.launch.stages)
    assert doc["signature"]["x"] == "*fp32" and [[0], [["tt.divisibility", 16]]] in doc["attrs"]
    assert doc["failed_in"] == "compile" and doc["ttir"] is None       # failed before TTIR
    argv = _command(message)
    assert argv[3] == str(path)
    proc = _rerun(argv)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "still fails" in proc.stderr and "power of 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    tally.case(CASE, "triton-compile-error")


def test_ptxas_failure__reproducer_has_ttir_and_compiles_with_the_real_triton(
        quant_step, tmp_path, triton_cache, monkeypatch, capsys):
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.errors import PTXASError

    def ptxas_fails(self, src, *args):  # type: ignore[no-untyped-def]
        print(src)                      # as Triton's ptxas failure does: the whole PTX
        raise PTXASError("`ptxas` failed with error code 1\n`ptxas` stderr:\n"
                         "ptxas fatal   : simulated")

    monkeypatch.setattr(CUDABackend, "make_cubin", ptxas_fails)
    with pytest.raises(CompileError, match="ptxas fatal   : simulated") as info:
        aot.compile_step(quant_step, 90, keep_dir=str(tmp_path))
    monkeypatch.undo()
    assert capsys.readouterr().out == ""            # the PTX went into the reproducer
    _assert_one_screen(str(info.value))
    path, doc = _saved(tmp_path)
    assert "tt.func" in doc["ttir"] and "@quantize" in doc["ttir"]
    assert ".entry quantize" in doc["triton_output"]
    proc = _rerun(_command(str(info.value)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: kernel 'quantize' compiles for sm_90" in proc.stdout
    tally.case(CASE, "triton-ptxas-failure")
    tally.case(CASE, "triton-reproduce-command")


def test_patched_triton_compile__reproducer_lands_in_the_current_folder(quant_step, tmp_path,
                                                                        monkeypatch):
    import triton

    def crashes(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated Triton crash\n" + "detail\n" * 40)

    monkeypatch.setattr(triton, "compile", crashes)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CompileError, match="RuntimeError: simulated Triton crash") as info:
        aot.compile_step(quant_step, 80)
    _assert_one_screen(str(info.value))                # Triton's 41 lines cut to the first 12
    path, _ = _saved(tmp_path)
    assert _command(str(info.value))[3] == str(path)
    tally.case(CASE, "triton-default-folder")


class _Kernel:
    """A stand-in for a compiled Triton kernel: ``k[grid](*args)`` raises the next of
    ``errors`` (``None``: runs and does nothing)."""

    def __init__(self, *errors: Exception | None) -> None:
        self.errors = list(errors)

    def __getitem__(self, grid: object) -> _Kernel:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        err = self.errors.pop(0) if self.errors else None
        if err is not None:
            raise err


def _stand_in(graph, **kernels: _Kernel) -> Program:  # type: ignore[no-untyped-def]
    module = ModuleType("stand_in_kernels")
    for name in ("quantize", "conv2d_igemm", "maxpool2d", "gemm"):
        setattr(module, name, kernels.get(name, _Kernel()))
    return lower_graph(graph, module, CPU)


def test_first_launch_failure_on_a_gpu__compile_error_with_reproducer(graph, tmp_path,
                                                                      triton_cache):
    from triton.runtime.errors import OutOfResources

    program = _stand_in(graph, quantize=_Kernel(OutOfResources(262144, 232448,
                                                               "shared memory")))
    program.keep_dir, program.arch = str(tmp_path), 90
    with pytest.raises(CompileError, match=r"^kernel 'quantize' \(chain quant\) failed at its "
                                           r"first launch on the GPU \(sm_90\)") as info:
        first_launches({1: program}, {1: graph})
    message = str(info.value)
    _assert_one_screen(message)
    assert "out of resource: shared memory" in message
    assert "ahead of time the same launch compiles" in message        # compiled again: it does
    _, doc = _saved(tmp_path)
    assert doc["failed_in"] == "launch" and "tt.func" in doc["ttir"]
    assert "compile it alone with: " in message
    tally.case(CASE, "triton-first-launch")


def test_kernel_failing_after_it_once_ran__is_not_called_a_compile_fault(graph):
    program = _stand_in(graph, quantize=_Kernel(None, RuntimeError("CUDA error: illegal "
                                                                   "memory access")))
    x = block_inputs(1).numpy()
    program.run_numpy(x)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        program.run_numpy(x)
    tally.case(CASE, "triton-later-launch")


def test_interpreter_failure_inside_a_kernel__is_a_clear_error(graph, tmp_path):
    program = lower_graph(graph, loader.kernels(True), CPU)
    program.keep_dir = str(tmp_path)
    program.steps[0] = _block(program.steps[0], 100)
    with pytest.raises(CompileError, match=r"^kernel 'quantize' \(chain quant\) failed in "
                                           r"Triton's interpreter\n") as info:
        program.run_numpy(block_inputs(1).numpy())
    message = str(info.value)
    _assert_one_screen(message)
    assert "power of 2" in message and "Traceback" not in message
    path, doc = _saved(tmp_path)
    assert doc["failed_in"] == "interpreter" and _command(message)[3] == str(path)
    tally.case(CASE, "triton-interpreter")


def test_cli_run_target_cuda__kernel_failure_is_one_screen_and_exits_non_zero(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_lower, "flat_block", lambda n: 100)   # every flat kernel fails
    recipe = tmp_path / "block.yaml"
    recipe.write_text(block_recipe("compile: {batch_sizes: [1]}\n"), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(recipe), "--target", "cuda", "--out",
                                      str(tmp_path / "out"), "-q"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("qcompile: error: kernel 'quantize' (chain quant) failed "
                                    "in Triton's interpreter")
    _assert_one_screen(result.output)
    path, _ = _saved(tmp_path / "out")                 # no keep_dir: the run's output folder
    assert str(path) in result.output
    tally.case(CASE, "triton-failure-cli-run")


# -- a reproducer that cannot be used is a clear error ----------------------------------------

def _valid(step: Step) -> dict:
    assert step.launch is not None
    spec = aot.launch_spec(step.launch, step.dtype, 80, label=step.label, loc=step.loc)
    return repro.document(spec, "compile", "RuntimeError: x", None, "")


def _with_source(doc: dict, source: str) -> dict:
    return {**doc, "source": source, "source_sha256": repro._sha256(source)}


CORRUPT = {   # case -> (damage to the valid reproducer's text, what the error says)
    "missing-file": (None, "cannot read it"),
    "not-json": (lambda t, d: t[:len(t) // 2], "it is not JSON"),
    "not-a-reproducer": (lambda t, d: "[1, 2]", "not a qcompile Triton reproducer"),
    "other-version": (lambda t, d: json.dumps({**d, "version": 99}), "reproducer version 99"),
    "missing-key": (lambda t, d: json.dumps({k: v for k, v in d.items() if k != "signature"}),
                    "key 'signature' is missing"),
    "wrong-type": (lambda t, d: json.dumps({**d, "num_warps": "4"}), "key 'num_warps'"),
    "bad-target": (lambda t, d: json.dumps({**d, "target": {"arch": "sm80"}}),
                   "key 'target' needs"),
    "edited-source": (lambda t, d: json.dumps({**d, "source": d["source"] + "\n#"}),
                      "does not match source_sha256"),
    "source-does-not-load": (lambda t, d: json.dumps(_with_source(d, "def broken(:\n")),
                             "its kernels source does not load"),
    "unknown-kernel": (lambda t, d: json.dumps({**d, "kernel": "nope"}),
                       "no kernel 'nope' in its source; kernels: "),
    "signature-mismatch": (lambda t, d: json.dumps({**d, "signature": {"x": "*fp32"}}),
                           "the signature names ['x'], the kernel takes"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_reproducer__clear_error_exit_2(case, quant_step, tmp_path, capsys):
    damage, says = CORRUPT[case]
    path = tmp_path / "r.failed.json"
    if damage is not None:
        doc = _valid(quant_step)
        path.write_text(damage(json.dumps(doc), doc), encoding="utf-8")
    assert repro.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qcompile: error: cannot use the Triton reproducer {path}\n"), err
    assert says in err and "next: " in err
    _assert_one_screen(err)
    tally.case(CASE, f"triton-repro-{case}")


def test_corrupt_reproducer__the_command_itself_prints_no_traceback(tmp_path):
    path = tmp_path / "r.failed.json"
    path.write_text('{"format": "qcompile-triton-repro", ', encoding="utf-8")
    argv = [sys.executable, "-m", "qcompile.codegen.triton.repro", str(path)]
    proc = _rerun(argv)
    assert proc.returncode == 2 and "it is not JSON" in proc.stderr
    _assert_one_screen(proc.stderr)
    assert _rerun(argv[:3]).returncode == 2                             # no file: usage
    tally.case(CASE, "triton-repro-command-corrupt")

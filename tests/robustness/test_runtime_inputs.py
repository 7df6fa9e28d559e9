"""Run-time inputs of a compiled ``cpu`` model: anything it cannot take is an ``InputError``
naming the input and what is wrong; strided and odd-layout tensors give the contiguous results;
NaN and infinities are refused (README, target cpu, "Inputs"); calls from several threads equal
serial calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import robustness_tally as tally
import torch
from concurrency import run_in_threads

import qcompile
from qcompile.errors import InputError

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))


def _with(value: float, index: tuple[int, ...] = (1, 2, 3, 4)) -> torch.Tensor:
    x = X.clone()
    x[index] = value
    return x


# (id, the call's arguments, what the error says)
BAD_INPUTS: list[tuple[str, Callable[[], tuple[Any, ...]], str]] = [
    ("no-input", lambda: (), "expected 1 inputs, got 0"),
    ("two-inputs", lambda: (X, X), "expected 1 inputs, got 2"),
    ("rank-0", lambda: (torch.tensor(1.0),), "rank is 0"),
    ("rank-3", lambda: (X[0],), "rank is 3"),
    ("rank-5", lambda: (X[None],), "rank is 5"),
    ("wrong-height", lambda: (X[:, :, :7],), r"shape is \[2, 3, 7, 8\]"),
    ("wrong-channels", lambda: (torch.zeros(2, 4, 8, 8),), r"expected \[batch, 3, 8, 8\]"),
    ("channels-last-shape", lambda: (X.permute(0, 2, 3, 1).contiguous(),), "shape is"),
    ("float64", lambda: (X.double(),), "dtype is torch.float64"),
    ("float16", lambda: (X.half(),), "dtype is torch.float16"),
    ("bfloat16", lambda: (X.bfloat16(),), "dtype is torch.bfloat16"),
    ("int64", lambda: (X.long(),), "dtype is torch.int64"),
    ("bool", lambda: (X > 0,), "dtype is torch.bool"),
    ("complex", lambda: (X.to(torch.complex64),), "dtype is torch.complex64"),
    ("meta-device", lambda: (torch.empty(2, 3, 8, 8, device="meta"),), "tensor is on meta"),
    ("sparse", lambda: (X.to_sparse(),), "sparse_coo tensor"),
    ("mkldnn", lambda: (X.to_mkldnn(),), "_mkldnn tensor"),
    ("nested", lambda: (torch.nested.nested_tensor([X[0], X[1]]),), "nested tensor"),
    ("empty-batch", lambda: (X[:0],), "the batch is empty"),
    ("batch-above-max", lambda: (torch.zeros(65, 3, 8, 8),), "exceeds the maximum 64"),
    ("numpy-array", lambda: (X.numpy(),), "got a ndarray"),
    ("python-list", lambda: (X.tolist(),), "got a list"),
    ("none", lambda: (None,), "got a NoneType"),
    ("nan", lambda: (_with(float("nan")),), r"1 non-finite value\(s\), the first nan at "
                                            r"index \[1, 2, 3, 4\]"),
    ("plus-inf", lambda: (_with(float("inf")),), "the first inf"),
    ("minus-inf", lambda: (_with(float("-inf")),), "the first -inf"),
    ("all-nan", lambda: (torch.full_like(X, float("nan")),), "384 non-finite"),
]


@pytest.fixture(scope="module")
def loaded(artifact):  # type: ignore[no-untyped-def]
    return qcompile.load(artifact)


@pytest.mark.parametrize("source", ["compiled", "loaded"])
@pytest.mark.parametrize("case_id, args, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input__input_error_naming_the_problem(request, source, case_id, args, message):
    model = request.getfixturevalue(source)
    try:
        with pytest.raises(InputError, match=message) as err:
            model(*args())
    except BaseException as unexpected:
        tally.record_unexpected(unexpected, f"input {case_id}")
        raise
    text = str(err.value)
    assert "next:" in text and len(text.splitlines()) <= 5
    tally.case("run-time input cases", case_id)


def test_bad_input__same_contract_on_the_reference_and_pt2e_targets(quantized):
    for target in ("reference", "pt2e"):
        model = qcompile.compile(quantized, target)
        for case_id, args, message in BAD_INPUTS:
            if case_id != "no-input":
                with pytest.raises(InputError, match=message):
                    model(*args())


# (id, an odd-layout tensor, the contiguous tensor it equals)
LAYOUTS: list[tuple[str, Callable[[], torch.Tensor]]] = [
    ("channels-last", lambda: X.contiguous(memory_format=torch.channels_last)),
    ("transposed-view", lambda: X.transpose(2, 3).contiguous().transpose(2, 3)),
    ("permuted-view", lambda: X.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)),
    ("expanded-batch", lambda: X[:1].expand(3, 3, 8, 8)),
    ("strided-batch", lambda: torch.cat([X, X]).reshape(2, 2, 3, 8, 8)[:, 0]),
    ("every-other-column", lambda: torch.cat([X, X], dim=3)[..., ::2]),
    ("storage-offset", lambda: torch.cat([X, X])[1:3]),
    ("requires-grad", lambda: X.clone().requires_grad_()),
    ("parameter", lambda: torch.nn.Parameter(X.clone())),
    ("from-numpy-fortran", lambda: torch.from_numpy(np.asfortranarray(X.numpy()))),
    ("inference-mode", lambda: _inference(X)),
]


def _inference(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return x.clone()


@pytest.mark.parametrize("source", ["compiled", "loaded"])
@pytest.mark.parametrize("case_id, make", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_odd_layouts__same_results_as_contiguous(request, source, case_id, make):
    model = request.getfixturevalue(source)
    x = make()
    assert not x.is_contiguous() or case_id in ("storage-offset", "requires-grad", "parameter",
                                                "inference-mode")
    want = model(x.detach().contiguous().clone())
    assert torch.equal(model(x), want)
    tally.case("run-time input cases", f"layout {case_id}")


@pytest.mark.parametrize("source", ["compiled", "loaded"])
def test_plain_call__takes_plain_inputs_and_leaves_the_rest_to_the_full_path(request, source):
    """Dense contiguous float32 tensors of a batch with a module of its own go straight to the
    module (CpuRunner.plain_call), with the full path's results; anything else is answered
    NotImplemented, so that the full path checks it (and raises its errors)."""
    model = request.getfixturevalue(source)
    model(X)
    plain = model._plain
    assert callable(plain)
    for x in (X, X[:1], _inference(X), X.clone().requires_grad_()):
        got = plain((x,))
        assert got is not NotImplemented
        assert torch.equal(got, model.runner(x.detach()))
    others = [(), (X, X), (X.double(),), (X[:, :, :7],), (X.permute(0, 1, 3, 2),),
              (torch.nn.Parameter(X.clone()),), (X.numpy(),), (None,), (X[:0],),
              (torch.cat([X, X[:1]]),), (X.to_sparse(),),
              (torch.nested.nested_tensor([X[0], X[1]]),),
              (torch.empty(2, 3, 8, 8, device="meta"),)]
    for args in others:
        assert plain(args) is NotImplemented, args
    tally.case("run-time input cases", f"plain call ({source})")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64])
def test_any_batch_up_to_max__equals_sample_by_sample(compiled, n):
    x = torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(n))
    rows = torch.cat([compiled(x[i:i + 1]) for i in range(n)])
    assert torch.equal(compiled(x), rows)
    tally.case("run-time input cases", f"batch {n}")


def test_finite_extremes__run_and_stay_finite(compiled):
    """Finite but extreme values saturate in the input quantize: no error, finite outputs."""
    info = torch.finfo(torch.float32)
    for case_id, value in [("float-max", info.max), ("float-lowest", info.min),
                           ("subnormal", info.smallest_normal / 4), ("minus-zero", -0.0),
                           ("huge", 1e30)]:
        out = compiled(_with(value))
        assert torch.isfinite(out).all(), case_id
        tally.case("run-time input cases", case_id)
    # -0.0 and +0.0 quantize to the same code
    assert torch.equal(compiled(_with(-0.0)), compiled(_with(0.0)))


@pytest.mark.parametrize("source", ["compiled", "loaded"])
def test_concurrent_calls__equal_serial_calls(request, source):
    model = request.getfixturevalue(source)
    g = torch.Generator().manual_seed(11)
    jobs = [torch.randn(n, 3, 8, 8, generator=g) for n in (1, 2, 3, 5, 1, 4, 2, 7) * 3]
    serial = [model(x) for x in jobs]
    results: list[Any] = [None] * len(jobs)
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        start.wait()
        for i in range(k, len(jobs), 8):
            results[i] = model(jobs[i])

    run_in_threads(worker, [(k,) for k in range(8)])
    assert all(torch.equal(r, s) for r, s in zip(results, serial, strict=True))
    tally.case("run-time input cases", f"threads {source}")


# --------------------------------------------------------------- qcompile exec on .npy files
def _npy_cases(folder: Path) -> dict[str, Path]:
    x = X.numpy()
    np.save(folder / "float64.npy", x.astype(np.float64))
    np.save(folder / "pickled-objects.npy", np.array([{"a": 1}], dtype=object),
            allow_pickle=True)
    (folder / "truncated.npy").write_bytes((_saved(folder, x)).read_bytes()[:200])
    (folder / "not-numpy.npy").write_text("1, 2, 3\n")
    np.save(folder / "wrong-shape.npy", x[:, :, :4])
    np.save(folder / "empty-batch.npy", x[:0])
    np.save(folder / "nan.npy", np.full_like(x, np.nan))
    np.savez(folder / "an-npz.npz", x=x)
    np.save(folder / "big-endian.npy", x.astype(">f4"))
    with open(folder / "huge-declared-shape.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                 "shape": (10**6, 3, 1000, 1000)})
        f.write(b"\0" * 64)
    return {p.stem: p for p in folder.iterdir()} | {"missing": folder / "missing.npy"}


def _saved(folder: Path, x: np.ndarray) -> Path:
    np.save(folder / "_ok.npy", x)
    return folder / "_ok.npy"


EXEC_XFAIL: dict[str, str] = {}   # strict: what qcompile exec would still get wrong
EXEC_CASES = ["float64", "pickled-objects", "truncated", "not-numpy", "wrong-shape",
              "empty-batch", "nan", "missing", "an-npz", "big-endian", "huge-declared-shape"]


@pytest.mark.parametrize("case_id", EXEC_CASES)
def test_exec__bad_npy_input_exits_2_without_traceback(artifact, tmp_path, request, case_id):
    from typer.testing import CliRunner

    from qcompile.cli import app

    if case_id in EXEC_XFAIL:
        request.applymarker(pytest.mark.xfail(strict=True, reason=EXEC_XFAIL[case_id]))
    inputs = _npy_cases(tmp_path)
    out = tmp_path / "out" / "y.npz"
    result = CliRunner().invoke(app, ["exec", str(artifact), "-i", str(inputs[case_id]), "-o",
                                      str(out)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
    assert result.output.startswith("qcompile: error: ") and not out.exists()
    tally.case("run-time input cases", f"exec {case_id}")


def test_exec__fortran_order_npy_equals_c_order(artifact, tmp_path):
    from typer.testing import CliRunner

    from qcompile.cli import app

    x = X.numpy()
    outs = []
    for name, arr in [("c", np.ascontiguousarray(x)), ("f", np.asfortranarray(x))]:
        np.save(tmp_path / f"{name}.npy", arr)
        result = CliRunner().invoke(app, ["exec", str(artifact), "-i", str(tmp_path /
                                          f"{name}.npy"), "-o", str(tmp_path / f"{name}.npz")])
        assert result.exit_code == 0, result.output
        outs.append(np.load(tmp_path / f"{name}.npz")["output_0"])
    np.testing.assert_array_equal(*outs)
    tally.case("run-time input cases", "exec fortran-order")


def test_non_finite__checked_by_the_quantize_kernel_not_by_a_pass_in_python(
        compiled, loaded, monkeypatch):
    """The block's input quantize is a microkernel that reads every input value: it reports a
    NaN or infinity, and a finite call makes no pass over the inputs in Python. A hit is then
    named exactly as the Python check names it."""
    import qcompile.runtime.compiled as cm

    assert compiled.runner.checks_finite and loaded.runner.checks_finite
    seen: list[int] = []
    real = cm._all_finite
    monkeypatch.setattr(cm, "_all_finite", lambda x: seen.append(1) or real(x))
    for model in (compiled, loaded):
        for batch in (1, 2, 3):            # 3: pieces of 2 and 1
            model(X.repeat(2, 1, 1, 1)[:batch])
    assert seen == []
    bad = X.repeat(2, 1, 1, 1)[:3].clone()
    bad[2, 0, 5, 6] = float("-inf")
    for model in (compiled, loaded):
        with pytest.raises(InputError, match=r"the first -inf at index \[2, 0, 5, 6\]"):
            model(bad)
        np.testing.assert_array_equal(model(X).numpy(), compiled(X).numpy())   # still runs
    assert seen


def test_non_finite__checked_in_python_where_no_kernel_reads_the_inputs(quantized):
    model = qcompile.compile(quantized, "cpu", {"batch_sizes": (2,), "analyze": False,
                                                "ukernel_convs": False})
    assert not model.runner.checks_finite
    with pytest.raises(InputError, match=r"the first nan at index \[1, 2, 3, 4\]"):
        model(_with(float("nan")))

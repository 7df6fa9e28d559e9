"""Run-time inputs of a compiled ``cpu`` model: anything it cannot take is an ``InputError``
naming the input and what is wrong; strided and odd-layout tensors give the contiguous results;
NaN and infinities are refused (README, target cpu, "Inputs"); calls from several threads equal
serial calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import robustness_tally as tally
import torch

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
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(k, len(jobs), 8):
                results[i] = model(jobs[i])
        except BaseException as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(torch.equal(r, s) for r, s in zip(results, serial, strict=True))
    tally.case("run-time input cases", f"threads {source}")

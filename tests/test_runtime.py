"""CompiledModel: input validation with clear errors."""

from __future__ import annotations

import pytest
import torch

import qcompile
from qcompile.errors import InputError, TargetUnavailableError


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    return qcompile.quantize_and_compile(model, (x,), calibration=[(x,)], target="pt2e")


def test_runs_any_batch(compiled):
    assert compiled(torch.randn(3, 3, 8, 8)).shape == (3, 5)


@pytest.mark.parametrize("bad, message", [
    (torch.randn(3, 8, 8), "rank is 3"),
    (torch.randn(1, 3, 9, 8), r"shape is \[1, 3, 9, 8\], expected \[batch, 3, 8, 8\]"),
    (torch.randn(1, 3, 8, 8, dtype=torch.float64), "dtype is torch.float64"),
    (torch.randn(0, 3, 8, 8), "the batch is empty"),
    (torch.randn(65, 3, 8, 8), "exceeds the maximum 64"),
    (torch.randn(1, 3, 8, 8).numpy(), "not a torch.Tensor"),
])
def test_bad_inputs_are_refused(compiled, bad, message):
    with pytest.raises(InputError, match=message):
        compiled(bad)


def test_wrong_input_count(compiled):
    with pytest.raises(InputError, match="expected 1 inputs, got 2"):
        compiled(torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8))


def test_unavailable_target_says_why(compiled):
    from qcompile.targets import compile_quantized

    with pytest.raises(TargetUnavailableError, match=r"(?s)target 'cuda'.*why:.*next:"):
        compile_quantized(None, "cuda")  # type: ignore[arg-type]

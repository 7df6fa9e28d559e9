"""The stable Python API (DESIGN.md, "User surface")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from calibration.protocol import Batch
from qcompile.frontend.quantize import QuantizeConfig, QuantizedModel
from qcompile.frontend.quantize import quantize as _quantize
from qcompile.runtime.compiled import CompiledModel


def quantize(model: nn.Module, example_inputs: tuple[torch.Tensor, ...],
             calibration: Iterable[Batch | tuple[torch.Tensor, ...]],
             config: QuantizeConfig | None = None) -> QuantizedModel:
    """PT2E-quantize ``model`` (export → prepare → calibrate on every batch → convert)."""
    return _quantize(model, example_inputs, calibration, config)


def compile(quantized: QuantizedModel, target: str = "pt2e",  # noqa: A001 - the API's name
            options: dict[str, Any] | None = None) -> CompiledModel:
    """Compile a PT2E-quantized model for ``target``."""
    from qcompile.targets import compile_quantized

    if options:
        raise TypeError(f"compile() got options it does not know: {sorted(options)}")
    return compile_quantized(quantized, target)


def quantize_and_compile(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                         calibration: Iterable[Batch | tuple[torch.Tensor, ...]],
                         target: str = "pt2e",
                         config: QuantizeConfig | None = None) -> CompiledModel:
    """``compile(quantize(...), target)`` in one call."""
    return compile(quantize(model, example_inputs, calibration, config), target)

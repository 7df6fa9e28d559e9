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
    """Compile a PT2E-quantized model for ``target``. ``options`` (cpu): ``batch_sizes``,
    ``float_ops`` ("fallback" or "error"), ``keep_dir``, ``analyze`` (see
    :class:`qcompile.codegen.target.CompileOptions`)."""
    from dataclasses import fields

    from qcompile.codegen.target import CompileOptions
    from qcompile.targets import compile_quantized

    known = {f.name for f in fields(CompileOptions)}
    if set(options or {}) - known:
        raise TypeError(f"compile() got options it does not know: "
                        f"{sorted(set(options or {}) - known)}; known: {sorted(known)}")
    opts = dict(options or {})
    if "batch_sizes" in opts:
        opts["batch_sizes"] = tuple(opts["batch_sizes"])
    return compile_quantized(quantized, target, CompileOptions(**opts))


def quantize_and_compile(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                         calibration: Iterable[Batch | tuple[torch.Tensor, ...]],
                         target: str = "pt2e",
                         config: QuantizeConfig | None = None) -> CompiledModel:
    """``compile(quantize(...), target)`` in one call."""
    return compile(quantize(model, example_inputs, calibration, config), target)

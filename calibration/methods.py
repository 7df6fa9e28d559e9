"""Calibration methods: how activation ranges are chosen from calibration data.

Each method is a torchao PT2E observer; :func:`observer_ctr` returns its constructor for a
``QuantizationSpec.observer_or_fake_quant_ctr`` and :func:`x86_config` builds the x86 inductor
quantizer's config with it.

==============  ============================================================  ==================
method          range                                                         options
==============  ============================================================  ==================
minmax          running min / max of everything seen                          —
moving_average  min / max averaged over batches                               averaging_constant
histogram       torchao's L2-error (MSE-style) search over a histogram        bins
percentile      the (100 - p)th and p-th percentiles of a histogram           percentile, bins
==============  ============================================================  ==================
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from calibration._quiet import quiet_torchao

with quiet_torchao():
    from torchao.quantization.pt2e.observer import (
        HistogramObserver,
        MinMaxObserver,
        MovingAverageMinMaxObserver,
    )
    from torchao.quantization.pt2e.quantizer import QuantizationSpec
    from torchao.quantization.pt2e.quantizer.utils import QuantizationConfig
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        get_default_x86_inductor_quantization_config,
    )

    from calibration.percentile import PercentileObserver
from qcompile.errors import RecipeError

EPS = 2**-12  # the smallest scale, as torchao's x86 default config uses
_OPTIONS: dict[str, dict[str, tuple[type, Any]]] = {  # method -> option -> (type, default)
    "minmax": {},
    "moving_average": {"averaging_constant": (float, 0.01)},
    "histogram": {"bins": (int, 2048)},
    "percentile": {"percentile": (float, 99.99), "bins": (int, 2048)},
}
_OBSERVERS = {
    "minmax": MinMaxObserver,
    "moving_average": MovingAverageMinMaxObserver,
    "histogram": HistogramObserver,
    "percentile": PercentileObserver,
}
METHODS: tuple[str, ...] = tuple(_OPTIONS)


def method_options(method: str) -> dict[str, Any]:
    """``{option: default}`` for ``method``."""
    _check_method(method)
    return {k: default for k, (_, default) in _OPTIONS[method].items()}


def check_method_options(method: str, options: dict[str, Any]) -> None:
    """Raise :class:`~qcompile.errors.RecipeError` for an unknown method, or an unknown or
    out-of-range option of it (what :func:`observer_ctr` would refuse), without building one."""
    _check_method(method)
    _check_options(method, options)


def observer_ctr(
    method: str,
    *,
    dtype: torch.dtype = torch.uint8,
    quant_min: int | None = None,
    quant_max: int | None = None,
    qscheme: torch.qscheme = torch.per_tensor_affine,
    **method_options: Any,
) -> Any:
    """The observer constructor (``Observer.with_args(...)``) of calibration ``method``.

    ``quant_min``/``quant_max`` default to the full range of ``dtype`` (uint8 0..255, int8
    -128..127). Unknown methods or options raise :class:`~qcompile.errors.RecipeError`.
    """
    _check_method(method)
    options = _check_options(method, method_options)
    lo, hi = _full_range(dtype)
    return _OBSERVERS[method].with_args(
        dtype=dtype,
        quant_min=lo if quant_min is None else quant_min,
        quant_max=hi if quant_max is None else quant_max,
        qscheme=qscheme,
        eps=EPS,
        **options,
    )


def x86_config(
    method: str,
    *,
    per_channel: bool = True,
    symmetric_activations: bool = False,
    **options: Any,
) -> QuantizationConfig:
    """torchao's default x86 inductor config with activations observed by ``method``.

    Activations: uint8 per-tensor affine (0..255), or int8 per-tensor symmetric (-128..127) with
    ``symmetric_activations``. Weights: int8 symmetric per output channel, or per tensor with
    ``per_channel=False``.
    """
    base = get_default_x86_inductor_quantization_config()
    act = activation_spec(method, symmetric=symmetric_activations, **options)
    weight = base.weight if per_channel else _per_tensor_weight(base.weight)
    return dataclasses.replace(
        base,
        input_activation=act,
        output_activation=None if base.output_activation is None else act,
        weight=weight,
    )


def activation_spec(method: str, *, symmetric: bool = False, **options: Any) -> QuantizationSpec:
    """The x86 activation :class:`QuantizationSpec` observed by ``method``."""
    base = get_default_x86_inductor_quantization_config().input_activation
    assert base is not None  # torchao's static config always quantizes activations
    if symmetric:
        dtype, lo, hi, qscheme = torch.int8, -128, 127, torch.per_tensor_symmetric
    else:
        dtype, lo, hi, qscheme = torch.uint8, 0, 255, torch.per_tensor_affine
    ctr = observer_ctr(method, dtype=dtype, quant_min=lo, quant_max=hi, qscheme=qscheme, **options)
    return dataclasses.replace(
        base,
        dtype=dtype,
        quant_min=lo,
        quant_max=hi,
        qscheme=qscheme,
        observer_or_fake_quant_ctr=ctr,
    )


def _per_tensor_weight(spec: QuantizationSpec | None) -> QuantizationSpec:
    assert spec is not None  # torchao's static config always quantizes weights
    return dataclasses.replace(
        spec,
        qscheme=torch.per_tensor_symmetric,
        ch_axis=None,
        observer_or_fake_quant_ctr=MinMaxObserver.with_args(
            dtype=spec.dtype,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=torch.per_tensor_symmetric,
            eps=EPS,
        ),
    )


def _full_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype in (torch.uint8, torch.quint8):
        return 0, 255
    if dtype in (torch.int8, torch.qint8):
        return -128, 127
    raise RecipeError(
        f"activation dtype {dtype} is not supported",
        at="calibration.method",
        why="qcompile quantizes activations to uint8 or int8",
        next="use dtype=torch.uint8 (affine) or torch.int8 (symmetric)",
    )


def _check_method(method: str) -> None:
    if method not in _OPTIONS:
        raise RecipeError(
            f"unknown calibration method {method!r}",
            at="calibration.method",
            why=f"valid methods: {', '.join(METHODS)}",
            next="use one of those (histogram is the x86 default)",
        )


def _check_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    valid = _OPTIONS[method]
    if unknown := sorted(set(options) - set(valid)):
        listed = ", ".join(f"{k} (default {d!r})" for k, (_, d) in valid.items()) or "none"
        raise RecipeError(
            f"unknown option {', '.join(map(repr, unknown))} for calibration method {method!r}",
            at="calibration.method",
            why=f"options of {method!r}: {listed}",
            next="remove or rename the option",
        )
    for key, value in options.items():
        _check_value(method, key, value, valid[key][0])
    return options


def _check_value(method: str, key: str, value: Any, kind: type) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and (kind is float or isinstance(value, int))
    limits = {"averaging_constant": (0.0, 1.0), "percentile": (50.0, 100.0), "bins": (16, 1 << 16)}
    lo, hi = limits[key]
    if not ok or not (lo < value <= hi if kind is float else lo <= value <= hi):
        span = f"in ({lo}, {hi}]" if kind is float else f"an integer in [{lo}, {hi}]"
        raise RecipeError(
            f"option {key}={value!r} of calibration method {method!r} is out of range",
            at="calibration.method",
            why=f"{key} must be {span}",
            next=f"use e.g. {key}={_OPTIONS[method][key][1]!r}",
        )

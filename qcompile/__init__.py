"""qcompile: a quantization-aware compiler for PyTorch (PT2E int8 graphs → fused int8 code)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["quantize", "compile", "quantize_and_compile", "load", "QuantizeConfig",
           "__version__"]


def __getattr__(name: str) -> Any:
    # torch and torchao load only when the API is used, so `qcompile --help` stays fast
    if name in ("quantize", "compile", "quantize_and_compile"):
        from qcompile import api

        return getattr(api, name)
    if name == "load":
        from qcompile.runtime.artifact import load

        return load
    if name == "QuantizeConfig":
        from qcompile.frontend.quantize import QuantizeConfig

        return QuantizeConfig
    raise AttributeError(f"module 'qcompile' has no attribute {name!r}")

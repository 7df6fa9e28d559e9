"""The engines a user would pick instead of qcompile, built from the same model and calibration
data, and qcompile's own ``cpu`` target. Each builder returns a callable taking the model's
inputs (torch tensors), or raises :class:`PeerUnavailable` saying why it cannot run here.

All engines use the same threads: torch's intra-op pool, ONNX Runtime's intra-op threads and
IREE's task system are all sized to the machine's cores (``threads()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Call = Callable[..., Any]


class PeerUnavailable(Exception):
    """An engine that cannot run here (the reason is reported, never hidden)."""


@dataclass
class Context:
    float_module: torch.nn.Module
    quantized: Any                      # QuantizedModel (qcompile's recipe quantizer)
    calibration: list[tuple[torch.Tensor, ...]]
    batch_sizes: tuple[int, ...]
    input_names: tuple[str, ...]
    workdir: Path


def threads() -> int:
    return torch.get_num_threads()


def eager_fp32(ctx: Context) -> Call:
    return ctx.float_module


def inductor_fp32(ctx: Context) -> Call:
    return torch.compile(ctx.float_module)


def pt2e_inductor_int8(ctx: Context) -> Call:
    """PT2E with the x86 Inductor quantizer, lowered by Inductor with freezing (oneDNN int8):
    what PyTorch documents for int8 CPU inference."""
    import torch._inductor.config as inductor_config

    from qcompile.frontend.quantize import QuantizeConfig, quantize

    q = quantize(ctx.float_module, ctx.calibration[0], ctx.calibration,
                 QuantizeConfig(quantizer="x86"))
    inductor_config.freezing = True
    return torch.compile(q.module)


def _onnx_fp32(ctx: Context) -> Path:
    path = ctx.workdir / "model_fp32.onnx"
    if path.exists():
        return path
    names = list(ctx.input_names)
    dynamic = {n: {0: "batch"} for n in names} | {"output": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(ctx.float_module, ctx.calibration[0], str(path), dynamo=False,
                          input_names=names, output_names=["output"], dynamic_axes=dynamic,
                          opset_version=17)
    return path


def _ort_session(path: Path) -> Call:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # no spinning after a call: the next engine measured must not find the cores taken
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*inputs: torch.Tensor) -> Any:
        return session.run(None, {n: x.numpy() for n, x in zip(names, inputs, strict=True)})

    return run


def ort_fp32(ctx: Context) -> Call:
    try:
        return _ort_session(_onnx_fp32(ctx))
    except Exception as err:  # the exporter raises many types
        raise PeerUnavailable(f"ONNX export failed: {type(err).__name__}: {err}") from err


def ort_int8(ctx: Context) -> Call:
    """ONNX Runtime static QDQ quantization (per-channel s8 weights, u8 activations) on the same
    calibration batches."""
    import logging

    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    src = _onnx_fp32(ctx)
    out = ctx.workdir / "model_int8.onnx"

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{n: x.numpy() for n, x in zip(ctx.input_names, b, strict=True)}
                            for b in ctx.calibration])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return _ort_session(out)


def ort_int8_dynamic(ctx: Context) -> Call:
    """ONNX Runtime dynamic quantization (per-channel s8 weights; activations quantized at run
    time from their own range, no calibration): what a transformer user reaches for first."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = _onnx_fp32(ctx)
    out = ctx.workdir / "model_int8_dynamic.onnx"
    logging.getLogger().setLevel(logging.ERROR)
    quantize_dynamic(str(src), str(out), per_channel=True, weight_type=QuantType.QInt8)
    return _ort_session(out)


def iree_qdq(ctx: Context) -> Call:
    raise PeerUnavailable("IREE on the unmodified Q/DQ graph needs a torch → MLIR importer "
                          "(iree-turbine), which this installation does not have")


def qcompile_cpu(ctx: Context) -> Call:
    from qcompile.codegen.target import CompileOptions, compile_cpu

    return compile_cpu(ctx.quantized, CompileOptions(batch_sizes=ctx.batch_sizes))


def qcompile_stock(ctx: Context) -> Call:
    """qcompile ``cpu`` with every conv on the stock lowering (im2col + IREE GEMM): what the VNNI
    conv microkernel gains, measured in the same run."""
    from qcompile.codegen.target import CompileOptions, compile_cpu

    return compile_cpu(ctx.quantized, CompileOptions(batch_sizes=ctx.batch_sizes,
                                                     ukernel_convs=False))


BUILDERS: dict[str, Callable[[Context], Call]] = {
    "eager_fp32": eager_fp32, "inductor_fp32": inductor_fp32,
    "pt2e_inductor_int8": pt2e_inductor_int8, "ort_fp32": ort_fp32, "ort_int8": ort_int8,
    "ort_int8_dynamic": ort_int8_dynamic, "iree_qdq": iree_qdq, "qcompile": qcompile_cpu,
    "qcompile_stock": qcompile_stock,
}

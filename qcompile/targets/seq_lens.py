"""Compile a token model at each of its sequence lengths (``QuantizedModel.seq_lens``).

The PT2E module was exported with a dynamic sequence dimension and calibrated once, at the
example's length. Every target lowers from the shapes of ``q.example_inputs``, so compiling at
length ``L`` is compiling ``at_length(q, L)``: the same converted module (same quantization
parameters) with example inputs of ``L`` tokens. The runners are put behind a
:class:`~qcompile.runtime.seq_lens.SeqLenRunner` (pad to a compiled length, slice back).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from qcompile.frontend.quantize import QuantizedModel
from qcompile.runtime.compiled import CompiledModel, InputSignature
from qcompile.runtime.seq_lens import SeqLenRunner, seq_dims


def at_length(q: QuantizedModel, length: int) -> QuantizedModel:
    """``q`` with example inputs of ``length`` tokens (the first token repeated: valid ids, a
    full mask; the values do not matter to lowering)."""
    if length == calibration_length(q):
        return q
    return dataclasses.replace(q, example_inputs=tuple(
        x[:, :1].expand(x.shape[0], length).contiguous() for x in q.example_inputs))


def calibration_length(q: QuantizedModel) -> int:
    return int(q.example_inputs[0].shape[1])


def output_shapes(q: QuantizedModel, length: int) -> list[tuple[int, ...]]:
    """Shapes of the PT2E module's outputs at ``length`` (batch 1): which output dimensions
    are the sequence length."""
    x = tuple(t[:1] for t in at_length(q, length).example_inputs)
    with torch.no_grad():
        out = q.module(*x)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [tuple(o.shape) for o in outs]


def signature(q: QuantizedModel, base: tuple[InputSignature, ...]) -> tuple[InputSignature, ...]:
    """``base`` (the calibration length's signature) taking any length up to the longest."""
    longest = max(q.seq_lens)
    return tuple(dataclasses.replace(s, shape=(longest, *s.shape[1:]), seq_lens=q.seq_lens)
                 for s in base)


def seq_report(q: QuantizedModel, compiled: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"compiled": compiled, "calibration": calibration_length(q)}
    if q.seq_why:
        out["why_one"] = q.seq_why
    return out


def compile_seq_lens(q: QuantizedModel, target: str,
                     build: Callable[[QuantizedModel, Any], CompiledModel], options: Any
                     ) -> CompiledModel:
    """One ``build`` per length of ``q.seq_lens`` (the dispatch analysis at the calibration
    length only), behind one :class:`SeqLenRunner`."""
    main = calibration_length(q)
    quiet = dataclasses.replace(options, analyze=False) if dataclasses.is_dataclass(options) \
        and hasattr(options, "analyze") else options
    models: dict[int, CompiledModel] = {}
    seconds: dict[str, float] = {}
    for length in q.seq_lens:
        t0 = time.perf_counter()
        models[length] = build(at_length(q, length), options if length == main else quiet)
        seconds[str(length)] = round(time.perf_counter() - t0, 3)
    dims = seq_dims({n: output_shapes(q, n) for n in (q.seq_lens[0], q.seq_lens[-1])})
    runner = SeqLenRunner({n: m.runner for n, m in models.items()}, dims, main)
    report = dict(models[main].report)
    report["seq_lens"] = {**seq_report(q, list(q.seq_lens)), "output_seq_dims": list(dims),
                          "compile_s_per_seq_len": seconds}
    compile_section = dict(report.get("compile", {}))
    compile_section["seq_lens"] = list(q.seq_lens)
    compile_section["per_seq_len"] = {str(n): {k: v for k, v in m.report.get("compile", {}).items()
                                               if k != "seq_lens"}
                                      for n, m in models.items() if n != main}
    report["compile"] = compile_section
    return CompiledModel(target, signature(q, models[main].signature), runner, report)

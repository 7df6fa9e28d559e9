"""The main job: recipe → model → PT2E int8 → each target → accuracy against float → report."""

from __future__ import annotations

import importlib
import logging
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import calibration
from calibration.protocol import Batch, InputSpec
from qcompile import targets as target_registry
from qcompile import zoo
from qcompile.accuracy.metrics import Comparison, compare_outputs
from qcompile.accuracy.thresholds import check_thresholds, checks_as_dicts
from qcompile.errors import DatasetError, ModelError, QCompileError
from qcompile.frontend.quantize import QuantizeConfig, QuantizedModel, quantize
from qcompile.recipe import Recipe
from qcompile.runtime.compiled import CompiledModel
from qcompile.runtime.seq_lens import SeqLenRunner

log = logging.getLogger("qcompile")


@dataclass
class ModelUnderTest:
    name: str
    module: nn.Module
    spec: InputSpec
    task: str
    default_dataset: str

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        reader = calibration.get_reader("random")
        return next(iter(reader.batches(self.spec, batch_size=self.spec.shapes[0][0],
                                        num_batches=1, split="calibration"))).inputs


def build_model(recipe: Recipe) -> ModelUnderTest:
    """The recipe's model: a zoo model, or ``entry: package.module:function``."""
    m = recipe.model
    if m.zoo is not None:
        z = zoo.build(m.zoo, seq_len=m.calibration_seq_len)
        spec = _override_shapes(z.spec, m.input_shapes, recipe.path)
        return ModelUnderTest(z.name, z.module, spec, z.task, z.default_dataset)
    module = _load_entry(m.entry or "", recipe.path)
    shapes = tuple(tuple(s) for s in m.input_shapes or ())
    dtypes = tuple(getattr(torch, d) for d in (m.input_dtypes or ["float32"] * len(shapes)))
    spec = InputSpec(shapes, dtypes, "tensor", tuple(f"input_{i}" for i in range(len(shapes))))
    return ModelUnderTest(m.entry or "", module.eval(), spec, "regression", "random")


def _override_shapes(spec: InputSpec, shapes: list[list[int]] | None, path: str) -> InputSpec:
    if shapes is None:
        return spec
    if len(shapes) != len(spec.shapes) or any(len(a) != len(b) for a, b in
                                               zip(shapes, spec.shapes, strict=True)):
        from qcompile.errors import RecipeError

        raise RecipeError(f"recipe {path}: model.input_shapes does not fit the model",
                          at=f"{path}: model.input_shapes",
                          why=f"got {shapes}; the model takes {len(spec.shapes)} inputs of ranks "
                              f"{[len(s) for s in spec.shapes]} (default {list(spec.shapes)})",
                          next="give one shape per input with the same rank, or drop the key")
    return InputSpec(tuple(tuple(s) for s in shapes), spec.dtypes, spec.kind, spec.names,
                     spec.mean, spec.std, spec.tokenizer)


def _load_entry(entry: str, path: str) -> nn.Module:
    mod_name, func_name = entry.split(":")
    try:
        func = getattr(importlib.import_module(mod_name), func_name)
        module = func()
    except (ImportError, AttributeError) as err:
        raise ModelError(f"cannot load model entry {entry!r}", at=f"{path}: model.entry",
                         why=f"{type(err).__name__}: {err}",
                         next="check the module is importable and defines that function") from err
    if isinstance(module, zoo.ZooModel):
        module = module.module
    if not isinstance(module, nn.Module):
        raise ModelError(f"model entry {entry!r} returned a {type(module).__name__}",
                         at=f"{path}: model.entry", why="expected a torch.nn.Module",
                         next="make the function return the float nn.Module")
    return module


def _reader(section: Any, fallback: str) -> Any:
    return calibration.get_reader(section.dataset or fallback, **section.options)


def calibration_batches(recipe: Recipe, mut: ModelUnderTest) -> Iterator[Batch]:
    """The recipe's calibration batches as a stream: each is made when asked for and dropped
    once observed, so memory does not grow with ``calibration.batches``. Call again for a second
    pass; ``list(...)`` where every batch is needed at once (the benchmarks)."""
    c = recipe.calibration
    reader = _reader(c, mut.default_dataset)
    yield from reader.batches(mut.spec, batch_size=c.batch_size, num_batches=c.batches,
                              split="calibration")


def evaluation_batches(recipe: Recipe, mut: ModelUnderTest, q: QuantizedModel) -> list[Batch]:
    e = recipe.evaluation
    reader = _reader(e, recipe.calibration.dataset or mut.default_dataset)
    size = e.batch_size if q.dynamic_batch else q.example_inputs[0].shape[0]
    batches = list(reader.batches(mut.spec, batch_size=size, num_batches=e.batches,
                                  split="evaluation"))
    if not q.dynamic_batch:
        batches = [b for b in batches if b.inputs[0].shape[0] == size]
    if not batches:
        raise DatasetError("evaluation saw no data", at="evaluation",
                           why=f"dataset {reader.name!r} yielded no batches of size {size}",
                           next="raise evaluation.batches or pick another evaluation dataset")
    return batches


def first_tensor(out: Any) -> torch.Tensor:
    """A model's main output: the tensor itself, or the first tensor of a tuple/dict output."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    raise ModelError("model output holds no tensor", why=f"got {type(out).__name__}",
                     next="return a tensor (or a tuple whose first item is one)")


def run_batches(fn: Any, batches: list[Batch], desc: str, progress: bool) -> np.ndarray:
    from tqdm import tqdm

    outs = []
    with torch.no_grad():
        for b in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
            outs.append(first_tensor(fn(*b.inputs)).float().numpy())
    return np.concatenate(outs)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for pkg in ("qcompile", "torch", "torchao", "iree-base-compiler", "iree-base-runtime",
                "onnxruntime", "numpy"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = "not installed"
    return found


def evaluate_target(recipe: Recipe, compiled: CompiledModel, batches: list[Batch],
                    float_out: np.ndarray, task: str, progress: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = run_batches(compiled, batches, f"evaluate {compiled.target}", progress)
    labels = _labels(batches)
    comparison = compare_outputs(float_out, out, task=task, labels=labels)
    checks = check_thresholds(recipe.accuracy, comparison)
    return {"status": "ok", "accuracy": _accuracy_dict(comparison, checks),
            "evaluate_s": round(time.perf_counter() - t0, 3), **compiled.report}


def _labels(batches: list[Batch]) -> np.ndarray | None:
    if any(b.labels is None for b in batches):
        return None
    return np.concatenate([b.labels.numpy() for b in batches])  # type: ignore[union-attr]


def _accuracy_dict(c: Comparison, checks: list[Any]) -> dict[str, Any]:
    return {"float": c.float_metrics, "int8": c.int8_metrics, "compare": c.compare,
            "checks": checks_as_dicts(checks), "passed": all(ch.passed for ch in checks)}


def run_recipe(recipe: Recipe, *, targets: list[str] | None = None, progress: bool = False,
               out_dir: str | Path | None = None) -> dict[str, Any]:
    """Quantize, run every target, measure accuracy; returns the report (see DESIGN.md keys).
    A failed compile leaves its IR in ``compile.keep_dir``, else in ``out_dir`` (the run's
    output folder), else in the current folder."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    mut = build_model(recipe)
    timings["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    q = quantize(mut.module, mut.example_inputs(), calibration_batches(recipe, mut),
                 QuantizeConfig.from_recipe(recipe), progress=progress)
    timings["quantize_s"] = time.perf_counter() - t0
    batches = evaluation_batches(recipe, mut, q)
    float_out = run_batches(mut.module, batches, "evaluate float", progress)
    options = compile_options(recipe, q, out_dir)
    per_target = {t: _run_target(recipe, q, t, batches, float_out, mut.task, progress, options)
                  for t in (targets or recipe.targets)}
    return _report(recipe, mut, q, batches, per_target, timings)


def _run_target(recipe: Recipe, q: QuantizedModel, target: str, batches: list[Batch],
                float_out: np.ndarray, task: str, progress: bool, options: Any
                ) -> dict[str, Any]:
    reason = target_registry.unavailable_reason(target)
    if reason is not None:
        log.warning("target %s skipped: %s", target, reason)
        return {"status": "unavailable", "reason": reason}
    t0 = time.perf_counter()
    try:
        compiled = target_registry.compile_quantized(q, target, options)
    except QCompileError as err:
        log.warning("target %s failed: %s", target, err)
        return {"status": "failed", "reason": str(err)}
    compile_s = round(time.perf_counter() - t0, 3)
    result = evaluate_target(recipe, compiled, batches, float_out, task, progress)
    from qcompile.accuracy.exactness import compare, vs_reference

    if target == "reference":
        graph = compiled.runner.graph(int(batches[0].inputs[0].shape[0]))
        result["exactness"] = {"vs_pt2e": compare(graph, q.module, batches[0].inputs)}
        result["attribution"] = _attribution(graph, q, batches[0].inputs)
    if target == "cpu":
        runner = compiled.runner
        small = min(runner.modules)
        x = batches[0].inputs
        # vs PT2E on the smallest compiled batch: the same QIR as target reference, which
        # compares the whole evaluation batch
        result["exactness"] = {"vs_reference": vs_reference(runner, x),
                               "vs_pt2e": compare(runner.modules[small].graph, q.module,
                                                  tuple(t[:small] for t in x))}
        if isinstance(runner, SeqLenRunner):
            result["exactness"]["vs_reference"]["per_seq_len"] = seq_len_exactness(runner, x)
        result["latency_ms"] = cpu_latency(compiled, q, x)
    if target == "ort":   # ONNX Runtime against the reference, every compiled batch size
        result["exactness"] = {"vs_reference": vs_reference(compiled.runner, batches[0].inputs)}
    return {**result, "compile_s": compile_s}


def seq_len_exactness(runner: SeqLenRunner, x: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Each compiled length's modules against the reference at batch 1, on the first evaluation
    sample cut or padded (id 0, mask 0) to that length (the calibration length: see above)."""
    from qcompile.accuracy.exactness import vs_reference

    def at(length: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.nn.functional.pad(t[:1, :length], (0, max(0, length - t.shape[1])))
                     for t in x)

    return {str(n): vs_reference(r, at(n)) for n, r in runner.runners.items()
            if n != runner.main}


def _attribution(graph: Any, q: QuantizedModel, x: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Per-chain SQNR vs float and PT2E; a diagnostic, so a failure is reported, not raised."""
    from qcompile.accuracy.attribution import attribution

    try:
        return attribution(graph, q, x)
    except Exception as err:  # noqa: BLE001 - diagnostics never fail a run
        log.warning("per-chain attribution failed: %s", err)
        return {"error": f"{type(err).__name__}: {err}"}


def compile_options(recipe: Recipe, q: QuantizedModel,
                    out_dir: str | Path | None = None) -> Any:
    """The recipe's ``compile`` section as target options."""
    from qcompile.codegen.target import CompileOptions

    c = recipe.compile
    sizes = c.batch_sizes or [1, recipe.evaluation.batch_size, *recipe.benchmark.batch_sizes]
    keep = c.keep_dir or (str(out_dir) if out_dir is not None else None)
    return CompileOptions(batch_sizes=tuple(sizes), float_ops=c.float_ops, keep_dir=keep,
                          ukernel_convs=c.ukernel_convs, winograd=c.winograd)


def cpu_latency(compiled: CompiledModel, q: QuantizedModel, x: tuple[torch.Tensor, ...]
                ) -> dict[str, Any]:
    """Median ms of the cpu target beside eager fp32 (``latency_ms.<engine>``, batch 1) and per
    batch size (1 and the largest compiled one), measured in the same run; the performance suite
    against every peer is ``qcompile bench``."""
    from qcompile.bench.latency import median_ms

    per_batch: dict[str, Any] = {}
    for b in sorted({1, max(compiled.runner.modules)}):
        if b > x[0].shape[0]:
            continue
        xb = tuple(t[:b].contiguous() for t in x)
        times = median_ms({"cpu": lambda xb=xb: compiled(*xb),
                           "eager_fp32": lambda xb=xb: q.float_module(*xb)})
        per_batch[str(b)] = {**times, "speedup_vs_eager_fp32": round(
            times["eager_fp32"]["median"] / times["cpu"]["median"], 3)}
    first = per_batch[min(per_batch, key=int)]
    return {"cpu": first["cpu"]["median"], "eager_fp32": first["eager_fp32"]["median"],
            "speedup_vs_eager_fp32": first["speedup_vs_eager_fp32"], "batch": int(min(
                per_batch, key=int)), "per_batch": per_batch}


def _report(recipe: Recipe, mut: ModelUnderTest, q: QuantizedModel,
            batches: list[Batch], per_target: dict[str, Any],
            timings: dict[str, float]) -> dict[str, Any]:
    ran = [t for t, r in per_target.items() if r["status"] == "ok"]
    primary = ran[0] if ran else next(iter(per_target))
    main = per_target[primary]
    return {
        "recipe": {"name": recipe.name, "path": recipe.path, "version": recipe.version},
        "model": {"name": mut.name, "task": mut.task,
                  "parameters": sum(p.numel() for p in mut.module.parameters()),
                  "input_shapes": [list(s) for s in mut.spec.shapes],
                  "dynamic_batch": q.dynamic_batch,
                  **({"seq_lens": list(q.seq_lens)} if q.seq_lens else {}),
                  **({"seq_lens_why": q.seq_why} if q.seq_why else {})},
        "target": primary,
        "versions": versions(),
        "quantization": {"quantizer": q.config.quantizer, "weights": q.config.weights,
                         "activations": q.config.activations,
                         "quantized_ops": q.quantized_ops,
                         "calibration": {"dataset": recipe.calibration.dataset
                                         or mut.default_dataset, "method": q.config.method,
                                         "batches": q.calibration_batches,
                                         "samples": q.calibration_samples}},
        "evaluation": {"dataset": recipe.evaluation.dataset or recipe.calibration.dataset
                       or mut.default_dataset, "batches": len(batches),
                       "samples": sum(len(b.inputs[0]) for b in batches)},
        "accuracy": main.get("accuracy", {"passed": False, "reason": main.get("reason")}),
        **{k: main[k] for k in ("exactness", "residency", "passes", "kernels", "latency_ms")
           if k in main},
        "targets": per_target,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }


def write_outputs(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    from qcompile.report.writer import write_report

    return write_report(report, Path(out_dir))

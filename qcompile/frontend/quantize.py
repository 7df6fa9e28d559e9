"""The PT2E front end: ``torch.export`` → ``prepare_pt2e`` → calibrate → ``convert_pt2e``.

The result is the Q/DQ graph PT2E defines (float ops between quantize/dequantize pairs), wrapped in
a :class:`QuantizedModel` that also counts what was quantized. Known pitfalls handled here: dead
code left in the exported graph (an unused pooler makes the quantizer trip over nodes nobody reads),
and calibration at batch sizes other than the example's (the batch dimension is exported dynamic).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from calibration.protocol import Batch
from qcompile.errors import ModelError, QuantizationError, RecipeError

log = logging.getLogger("qcompile")

QUANT_OPS = frozenset({"quantize_per_tensor", "quantize_per_channel", "quantize_per_tensor_tensor"})
DEQUANT_OPS = frozenset(
    {"dequantize_per_tensor", "dequantize_per_channel", "dequantize_per_tensor_tensor"})


@dataclass(frozen=True)
class QuantizeConfig:
    """How to quantize; mirrors the recipe's ``quantizer`` and ``calibration.method`` keys."""

    quantizer: str = "x86"
    weights: str = "per_channel_symmetric"
    activations: str = "per_tensor_affine"
    method: str = "histogram"
    method_options: dict[str, Any] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    max_batch: int = 64
    float_residual_stream: bool = False   # quantizer "qcompile" only
    # token models: the sequence lengths to compile (the example's length among them); the
    # export makes dim 1 dynamic up to the longest. Empty: the example's length only.
    seq_lens: tuple[int, ...] = ()

    @classmethod
    def from_recipe(cls, recipe: Any) -> QuantizeConfig:
        q, c = recipe.quantizer, recipe.calibration
        return cls(q.kind, q.weights, q.activations, c.method, dict(c.method_options),
                   tuple(q.skip), recipe.model.max_batch, q.float_residual_stream,
                   recipe.model.compiled_seq_lens)


@dataclass
class QuantizedModel:
    """A PT2E-converted model: ``module`` is the Q/DQ ``GraphModule``; calling it runs PT2E's
    float simulation of int8 (the "pt2e" target). ``seq_lens``: the sequence lengths (dim 1 of
    every input) the targets compile; empty for models without one, the example's length alone
    when the export could not make it dynamic (``seq_why`` says why)."""

    module: torch.fx.GraphModule
    float_module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    config: QuantizeConfig
    quantized_ops: dict[str, int]
    calibration_batches: int
    dynamic_batch: bool
    calibration_samples: int = 0
    seq_lens: tuple[int, ...] = ()
    seq_why: str | None = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        with torch.no_grad():
            return self.module(*inputs)


def import_torchao() -> None:
    """Import torchao's PT2E modules with its start-up chatter (optional CUDA kernels that cannot
    load on a CPU machine) kept out of the user's terminal."""
    from calibration._quiet import quiet_torchao

    with quiet_torchao():
        import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401


def export_model(module: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                 max_batch: int = 64) -> tuple[torch.export.ExportedProgram, bool]:
    """Export with a dynamic batch dimension when the model allows it, else with static shapes.

    Returns the program and whether its batch dimension is dynamic.
    """
    module = module.eval()
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    dynamic = tuple({0: batch} for _ in example_inputs)
    # an example batch of 1 gets specialised to the constant 1; trace with 2 rows instead
    traced = tuple(x.repeat(2, *([1] * (x.dim() - 1))) if x.shape[0] == 1 else x
                   for x in example_inputs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(module, traced, dynamic_shapes=dynamic), True
    except Exception as err:  # noqa: BLE001 - any export failure means "try static shapes"
        log.info("dynamic-batch export failed (%s); exporting static shapes", str(err)[:200])
    try:
        return torch.export.export(module, example_inputs), False
    except Exception as err:
        raise ModelError(
            f"torch.export failed for {type(module).__name__}",
            at=f"{type(module).__module__}.{type(module).__qualname__}",
            why=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
            next="make the model exportable (no data-dependent Python control flow); see "
                 "the torch.export documentation on graph breaks") from err


def export_token_model(module: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                       max_batch: int, max_seq: int
                       ) -> tuple[torch.export.ExportedProgram, bool, str | None]:
    """Export with dynamic batch and sequence dimensions (dim 1 of every input, up to
    ``max_seq``); when torch.export refuses, as :func:`export_model` does (static length).

    Returns the program, whether its batch dimension is dynamic, and why the sequence dimension
    is static (``None`` when it is dynamic)."""
    module = module.eval()
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    # sizes 1 get specialised to constants: trace with at least 2 rows and 2 tokens
    traced = tuple(x.repeat(2 if x.shape[0] == 1 else 1, 2 if x.shape[1] == 1 else 1)
                   for x in example_inputs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(module, traced,
                                          dynamic_shapes=tuple({0: batch, 1: seq}
                                                               for _ in example_inputs))
        return program, True, None
    except Exception as err:  # noqa: BLE001 - any export failure means "one length only"
        why = f"torch.export refused a dynamic sequence length ({type(err).__name__}: " \
              f"{str(err).splitlines()[0][:200] if str(err) else ''})"
        log.warning("%s; compiling the calibration length only", why)
    program, dynamic = export_model(module, example_inputs, max_batch=max_batch)
    return program, dynamic, why


def check_token_inputs(example_inputs: tuple[torch.Tensor, ...], seq_lens: tuple[int, ...]
                       ) -> None:
    """Several sequence lengths need a token model: ``(input_ids, attention_mask)``, both
    integer ``(N, S)`` (a shorter input is padded with id 0 and mask 0, masking the padding),
    with ``S`` among ``seq_lens``."""
    shapes = [tuple(x.shape) for x in example_inputs]
    if len(example_inputs) != 2 or len(set(shapes)) != 1 or len(shapes[0]) != 2 or any(
            x.dtype.is_floating_point or x.dtype == torch.bool for x in example_inputs):
        raise ModelError(
            "seq_lens needs a token model taking (input_ids, attention_mask)",
            at="quantize config seq_lens",
            why=f"the model takes {[f'{x.dtype}{list(x.shape)}' for x in example_inputs]}; "
                "padding to a compiled length is only correct with an attention mask that "
                "hides the padded tokens",
            next="drop seq_lens (compile the example's length only)")
    if shapes[0][1] not in seq_lens:
        raise ModelError(
            f"the example inputs have length {shapes[0][1]}, not one of seq_lens "
            f"{list(seq_lens)}", at="quantize config seq_lens",
            why="the model is calibrated at the example's length, which must be compiled too",
            next=f"add {shapes[0][1]} to seq_lens")


NO_OP_IN_EVAL = frozenset({"dropout", "alpha_dropout", "feature_dropout", "clone", "contiguous"})


def _prepared_graph(exported: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The exported graph without dead code and without eval-mode no-ops (dropout sitting between
    a linear and its residual add would hide that pattern from the quantizer)."""
    gm = exported.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and op_name(node) in NO_OP_IN_EVAL and node.args:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def make_quantizer(config: QuantizeConfig, module: nn.Module) -> Any:
    """The torchao quantizer for ``config``, with ``config.skip`` modules left in float."""
    import_torchao()
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

    from calibration.methods import x86_config

    qconfig = x86_config(config.method, per_channel=config.weights == "per_channel_symmetric",
                         symmetric_activations=config.activations == "per_tensor_symmetric",
                         **config.method_options)
    if config.quantizer == "qcompile":
        from qcompile.frontend.quantizer import QCompileQuantizer

        quantizer = QCompileQuantizer(float_residual_stream=config.float_residual_stream)
    else:
        if config.float_residual_stream:
            raise RecipeError(
                "quantizer.float_residual_stream needs quantizer kind 'qcompile'",
                at="quantizer.float_residual_stream",
                why=f"the {config.quantizer} quantizer has no float residual stream option",
                next="set quantizer.kind to 'qcompile', or float_residual_stream to false")
        quantizer = X86InductorQuantizer()
    quantizer.set_global(qconfig)
    names = dict(module.named_modules())
    for name in config.skip:
        if name not in names:
            _raise_unknown_skip(name, names)
        quantizer.set_module_name_qconfig(name, None)
    return quantizer


def _raise_unknown_skip(name: str, names: dict[str, nn.Module]) -> None:
    import difflib

    close = difflib.get_close_matches(name, [n for n in names if n], n=3)
    raise RecipeError(
        f"quantizer.skip names a module the model does not have: {name!r}",
        at="quantizer.skip", why=f"closest module names: {', '.join(close) or '(none)'}",
        next="use names from model.named_modules(), e.g. 'layer1.0.conv1'")


def quantize(model: nn.Module, example_inputs: tuple[torch.Tensor, ...],
             calibration: Iterable[Batch | tuple[torch.Tensor, ...]],
             config: QuantizeConfig | None = None, *, progress: bool = False) -> QuantizedModel:
    """Quantize ``model`` with PT2E, calibrating on every batch of ``calibration``."""
    import_torchao()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = config or QuantizeConfig()
    seq_why = None
    if config.seq_lens:
        check_token_inputs(example_inputs, config.seq_lens)
    if len(config.seq_lens) > 1:
        exported, dynamic, seq_why = export_token_model(
            model, example_inputs, max_batch=config.max_batch, max_seq=max(config.seq_lens))
    else:
        exported, dynamic = export_model(model, example_inputs, max_batch=config.max_batch)
    prepared = prepare_pt2e(_prepared_graph(exported), make_quantizer(config, model))
    count, samples = _calibrate(prepared, calibration, example_inputs, dynamic, progress)
    converted = convert_pt2e(prepared)
    ops = count_quantized_ops(converted)
    if not ops:
        raise QuantizationError(
            f"PT2E quantized nothing in {type(model).__name__}",
            at=f"{type(model).__module__}.{type(model).__qualname__}",
            why="the quantizer annotated no conv/linear/matmul/add node"
                + (f" (skip list: {', '.join(config.skip)})" if config.skip else ""),
            next="check quantizer.skip in the recipe, or that the model has conv/linear layers")
    seq_lens = () if not config.seq_lens else (
        (int(example_inputs[0].shape[1]),) if seq_why else tuple(sorted(set(config.seq_lens))))
    return QuantizedModel(converted, model, example_inputs, config, ops, count, dynamic, samples,
                          seq_lens, seq_why)


def _calibrate(prepared: torch.fx.GraphModule, batches: Iterable[Any],
               example_inputs: tuple[torch.Tensor, ...], dynamic: bool, progress: bool
               ) -> tuple[int, int]:
    """Feeds ``batches`` through the observers one at a time (a stream: none is kept); returns
    how many batches and samples it saw."""
    from tqdm import tqdm

    count = samples = 0
    with torch.no_grad():
        for item in tqdm(batches, desc="calibrate", unit="batch", disable=not progress,
                         leave=False):
            inputs = item.inputs if isinstance(item, Batch) else tuple(item)
            _check_calibration_batch(inputs, example_inputs, dynamic, count)
            prepared(*inputs)
            count += 1
            samples += len(inputs[0]) if inputs and inputs[0].dim() else 1
            del item, inputs
    if count == 0:
        raise QuantizationError(
            "calibration saw no data", at="calibration",
            why="the calibration dataset yielded no batches",
            next="set calibration.batches ≥ 1 and check the dataset has samples")
    return count, samples


def _check_calibration_batch(inputs: tuple[torch.Tensor, ...], example: tuple[torch.Tensor, ...],
                             dynamic: bool, index: int) -> None:
    if len(inputs) != len(example):
        raise QuantizationError(
            f"calibration batch {index} has {len(inputs)} inputs, the model takes {len(example)}",
            at=f"calibration batch {index}", why="the dataset does not fit the model",
            next="choose a calibration dataset made for this model")
    for i, (got, want) in enumerate(zip(inputs, example, strict=True)):
        same = got.shape[1:] == want.shape[1:] and (dynamic or got.shape[0] == want.shape[0])
        if not same or got.dtype != want.dtype:
            raise QuantizationError(
                f"calibration batch {index}, input {i}: got {got.dtype}{list(got.shape)}, the "
                f"model was exported for {want.dtype}{list(want.shape)}",
                at=f"calibration batch {index}",
                why="shape or dtype differs" + ("" if dynamic else
                                                 " (the model exported with a static batch)"),
                next="set calibration.batch_size to the model's batch size or fix the dataset")


def op_name(node: torch.fx.Node) -> str:
    """``torch.ops.aten.conv2d.default`` → ``conv2d``; other targets by their name."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    if hasattr(target, "_schema"):
        name = target._schema.name.split("::")[-1]  # type: ignore[union-attr]
    return name.split(".")[0]


def count_quantized_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Compute ops that read at least one dequantized tensor, by op name."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) in QUANT_OPS | DEQUANT_OPS:
            continue
        if any(isinstance(a, torch.fx.Node) and a.op == "call_function"
               and op_name(a) in DEQUANT_OPS for a in node.all_input_nodes):
            counts[op_name(node)] += 1
    return dict(sorted(counts.items()))

"""QCompileQuantizer: int8 chains without float islands, on a tiny CNN, the zoo CNNs and the
transformers; accuracy against float next to the x86 quantizer's."""

from __future__ import annotations

import warnings
from functools import cache

import pytest
import torch
from torch import nn

from calibration.methods import activation_spec, x86_config
from qcompile import zoo
from qcompile.accuracy.metrics import cosine_per_sample, sqnr_db
from qcompile.errors import RecipeError
from qcompile.frontend.quantize import (
    DEQUANT_OPS,
    QUANT_OPS,
    QuantizeConfig,
    _prepared_graph,
    export_model,
    op_name,
    quantize,
)
from qcompile.frontend.quantizer import QCompileQuantizer, float_islands, windowed
from qcompile.recipe import recipe_from_dict

CNNS = ("resnet18", "mobilenet_v2", "efficientnet_lite0", "digits_cnn")
TRANSFORMERS = ("bert_encoder", "minilm")
INT8_IN_OUT = ("matmul", "softmax", "layer_norm", "gelu")


class StemResidualCNN(nn.Module):
    """conv-bn-relu → maxpool → (conv-bn-relu, conv-bn, add, relu) → avgpool → flatten → fc,
    with functional relus as in the zoo's ResNet (x86's relu patterns match modules only)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.pool = nn.MaxPool2d(2)
        self.conv_a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.conv_b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(torch.relu(self.stem(x)))
        y = torch.relu(self.conv_b(torch.relu(self.conv_a(y))) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


@pytest.fixture(scope="module")
def stem_cnn() -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = StemResidualCNN().eval()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(3)]


@cache
def _zoo(name: str) -> zoo.ZooModel:
    return zoo.build(name, seq_len=16) if name in TRANSFORMERS else zoo.build(name)


@cache
def _quantized(name: str, kind: str):  # noqa: ANN202 - a QuantizedModel
    model = _zoo(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize(model.module, model.example_inputs(2), [model.example_inputs(4)],
                        QuantizeConfig(quantizer=kind))


def _compare(name: str, quantized) -> dict[str, float]:  # noqa: ANN001
    model = _zoo(name)
    inputs = model.example_inputs(2)
    with torch.no_grad():
        ref, got = model.module(*inputs).numpy(), quantized(*inputs).numpy()
    return {"sqnr_db": sqnr_db(ref, got), "cosine": float(cosine_per_sample(ref, got).mean())}


def _quantize_with(quantizer: QCompileQuantizer, name: str):  # noqa: ANN202 - a GraphModule
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model = _zoo(name)
    exported, _ = export_model(model.module, model.example_inputs(2))
    quantizer.set_global(x86_config("histogram"))
    prepared = prepare_pt2e(_prepared_graph(exported), quantizer)
    with torch.no_grad():
        prepared(*model.example_inputs(4))
    return convert_pt2e(prepared)


def _is_dq(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and op_name(node) in DEQUANT_OPS


def _nodes(gm: torch.fx.GraphModule, *ops: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n) in ops]


# --- the tiny CNN: x86 leaves islands, qcompile none ---------------------------------------------


def test_stem_cnn__x86_leaves_islands_qcompile_none(stem_cnn):
    model, batches = stem_cnn
    x86 = quantize(model, batches[0], batches, QuantizeConfig(quantizer="x86"))
    ours = quantize(model, batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    islands = float_islands(x86.module)
    consumers = {c for i in islands for c in i["consumers"]}
    assert {"max_pool2d", "adaptive_avg_pool2d", "flatten"} <= consumers
    assert all(i["reason"] == "float activation" and i["location"] for i in islands)
    assert float_islands(ours.module) == []
    pool, flatten = _nodes(ours.module, "max_pool2d", "flatten")
    assert _is_dq(pool.args[0]) and _is_dq(flatten.args[0])
    assert all(op_name(u) in QUANT_OPS for u in pool.users)


def test_stem_cnn__maxpool_and_flatten_share_their_input_qparams(stem_cnn):
    model, batches = stem_cnn
    gm = quantize(model, batches[0], batches, QuantizeConfig(quantizer="qcompile")).module
    for node in _nodes(gm, "max_pool2d", "flatten"):
        (q_out,) = node.users
        assert node.args[0].args[1:3] == q_out.args[1:3]  # same scale and zero point


def test_stem_cnn__skipped_module_stays_float(stem_cnn):
    model, batches = stem_cnn
    config = QuantizeConfig(quantizer="qcompile", skip=("conv_b",))
    gm = quantize(model, batches[0], batches, config).module
    conv_b = next(n for n in _nodes(gm, "conv2d") if "conv_b" in str(n.meta["nn_module_stack"]))
    assert not _is_dq(conv_b.args[0]) and not _is_dq(conv_b.args[1])
    assert any(conv_b.name in i["consumers"] for i in float_islands(gm))  # float input
    others = [n for n in _nodes(gm, "conv2d") if n is not conv_b]
    assert all(_is_dq(n.args[1]) for n in others)


def test_quantizer__unknown_skip_name_is_a_recipe_error(stem_cnn):
    model, batches = stem_cnn
    with pytest.raises(RecipeError, match="closest module names: conv_b"):
        quantize(model, batches[0], batches, QuantizeConfig(quantizer="qcompile", skip=("conv_c",)))


# --- zoo CNNs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CNNS)
def test_zoo_cnn__no_float_islands_and_close_to_float(name):
    ours, x86 = _quantized(name, "qcompile"), _quantized(name, "x86")
    assert float_islands(ours.module) == []
    got, base = _compare(name, ours), _compare(name, x86)
    print(f"{name}: x86 {base} islands={len(float_islands(x86.module))}; qcompile {got}")
    assert got["cosine"] > 0.98
    assert got["sqnr_db"] > base["sqnr_db"] - 1.0  # the extra int8 boundaries cost < 1 dB


# --- transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformer__attention_softmax_norm_gelu_are_int8_bounded(name):
    gm = _quantized(name, "qcompile").module
    for node in _nodes(gm, *INT8_IN_OUT):
        operands = node.args[:2] if op_name(node) == "matmul" else node.args[:1]
        assert all(_is_dq(a) for a in operands), node.name
        assert all(op_name(u) in QUANT_OPS or u.op == "output" for u in node.users), node.name
    for emb in _nodes(gm, "embedding"):  # lookups stay float, quantized right after
        assert not _is_dq(emb.args[0]) and all(op_name(u) in QUANT_OPS for u in emb.users)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformer__only_the_mask_arithmetic_stays_float(name):
    before = float_islands(_quantized(name, "x86").module)
    after = float_islands(_quantized(name, "qcompile").module)
    print(f"{name}: islands x86 {len(before)} -> qcompile {len(after)}: "
          f"{[(i['name'], i['op']) for i in after]}")
    assert len(before) > 10 * len(after)
    assert {i["reason"] for i in after} == {"input-derived"}
    assert {i["op"] for i in after} <= {"to", "transpose", "unsqueeze", "rsub", "mul"}


def test_bert__padded_inputs_after_unpadded_calibration():
    """Calibration saw only full masks; the float mask bias still masks padded keys."""
    model, quantized = _zoo("bert_encoder"), _quantized("bert_encoder", "qcompile")
    ids, mask = model.example_inputs(2)
    mask = mask.clone()
    mask[:, 10:] = 0
    with torch.no_grad():
        ref, got = model.module(ids, mask).numpy(), quantized(ids, mask).numpy()
    assert float(cosine_per_sample(ref, got).mean()) > 0.99


def test_minilm__float_residual_stream_recovers_outlier_accuracy():
    default = _compare("minilm", _quantized("minilm", "qcompile"))
    residual = _compare("minilm", _quantize_with(QCompileQuantizer(float_residual_stream=True),
                                                 "minilm"))
    x86 = _compare("minilm", _quantized("minilm", "x86"))
    print(f"minilm: x86 {x86}; qcompile {default}; qcompile float residual {residual}")
    assert residual["cosine"] > 0.98 and residual["cosine"] > default["cosine"]


# --- the softmax-input observer, the recipe ------------------------------------------------------


def test_windowed_observer__ignores_masked_logits():
    observer = windowed(activation_spec("minmax")).observer_or_fake_quant_ctr()
    scores = torch.tensor([[1.0, 3.0, -10000.0], [0.0, -2.0, -10000.0]])
    assert torch.equal(observer(scores), scores)
    scale, _ = observer.calculate_qparams()
    assert float(scale) < 20.0 / 255  # range [3 - 16, 3], not [-10000, 3]


def test_recipe__accepts_qcompile_quantizer():
    recipe = recipe_from_dict({"version": 1, "name": "digits", "model": {"zoo": "digits_cnn"},
                               "quantizer": {"kind": "qcompile"}})
    assert QuantizeConfig.from_recipe(recipe).quantizer == "qcompile"
    with pytest.raises(RecipeError, match="kind"):
        recipe_from_dict({"version": 1, "name": "d", "model": {"zoo": "digits_cnn"},
                          "quantizer": {"kind": "arm"}})

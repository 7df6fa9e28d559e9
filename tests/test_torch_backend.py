"""torch.compile(model, backend="qcompile") on PT2E-converted models: registered through the
entry point, bit-exact with target cpu, graph breaks and regions it cannot compile run eagerly
with the reason recorded."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import calibration
from qcompile import torch_backend, zoo
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig, quantize


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch_backend.reset()
    yield
    torch._dynamo.reset()


def _zoo_quantized(name: str, batch: int):
    m = zoo.build(name)
    data = list(calibration.get_reader(m.default_dataset).batches(
        m.spec, batch_size=batch, num_batches=4, split="calibration"))
    q = quantize(m.module, data[0].inputs, data, QuantizeConfig(quantizer="qcompile"))
    x = next(iter(calibration.get_reader(m.default_dataset).batches(
        m.spec, batch_size=batch, num_batches=1, split="evaluation"))).inputs[0]
    return q, x


def _compiled(module: nn.Module, **options):
    return torch.compile(module, backend="qcompile", options=options or None)


def test_backend__registered_through_the_entry_point():
    assert "qcompile" in torch._dynamo.list_backends()


def test_digits_cnn__bit_exact_with_target_cpu_at_two_batch_sizes():
    q, x = _zoo_quantized("digits_cnn", 8)
    want = compile_cpu(q, CompileOptions(batch_sizes=(1, 8), analyze=False))
    model = _compiled(q.module)
    with torch.no_grad():
        for xb in (x, x[:1]):
            assert torch.equal(model(xb), want(xb))
    records = torch_backend.regions()
    assert records and all(r["status"] == "compiled" for r in records), records
    assert sorted(s[0][0] for r in records for s in r["signatures"]) == [1, 8]
    assert all(r["chains"] >= 3 for r in records)


class Postprocessed(nn.Module):
    """A PT2E model, a graph break, then float post-processing (softmax)."""

    def __init__(self, q: nn.Module) -> None:
        super().__init__()
        self.q = q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.q(x)
        torch._dynamo.graph_break()
        return torch.softmax(logits, dim=1)


def _tiny(config: QuantizeConfig):
    from tiny_models import TinyCNN

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(3)]
    return quantize(TinyCNN().eval(), batches[0], batches, config), batches[1][0]


def test_graph_break__quantized_region_compiled_float_region_eager(caplog):
    q, x = _tiny(QuantizeConfig(quantizer="qcompile"))
    want = compile_cpu(q, CompileOptions(batch_sizes=(4,), analyze=False))(x)
    with caplog.at_level(logging.WARNING, logger="qcompile"), torch.no_grad():
        got = _compiled(Postprocessed(q.module))(x)
    assert torch.equal(got, torch.softmax(want, dim=1))
    status = [(r["status"], r["reason"]) for r in torch_backend.regions()]
    assert status[0] == ("compiled", None)
    assert status[1][0] == "eager" and "no PT2E quantize op" in status[1][1]
    assert "region 1 runs eagerly" in caplog.text


def test_region_the_pipeline_rejects__runs_eagerly_with_the_reason(caplog):
    q, x = _tiny(QuantizeConfig(quantizer="x86"))        # leaves float ops inside the region
    with caplog.at_level(logging.WARNING, logger="qcompile"), torch.no_grad():
        got = _compiled(q.module, target="reference", float_ops="error")(x)
        assert torch.equal(got, q.module(x))
    (record,) = torch_backend.regions()
    assert record["status"] == "eager"
    assert "UnsupportedGraphError" in record["reason"] and "check-integer-only" in record["reason"]
    assert "runs eagerly: UnsupportedGraphError" in caplog.text


def test_options__ort_target_matches_cpu_and_unknown_options_are_refused():
    q, x = _tiny(QuantizeConfig(quantizer="qcompile"))
    want = compile_cpu(q, CompileOptions(batch_sizes=(4,), analyze=False))(x)
    with torch.no_grad():
        assert torch.equal(_compiled(q.module, target="ort")(x), want)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="options it does not know"):
            _compiled(q.module, target="tpu")(x)


@pytest.mark.slow
def test_resnet18__bit_exact_with_target_cpu():
    q, x = _zoo_quantized("resnet18", 2)
    want = compile_cpu(q, CompileOptions(batch_sizes=(2,), analyze=False))
    with torch.no_grad():
        assert torch.equal(_compiled(q.module)(x), want(x))
    assert torch_backend.regions()[0]["status"] == "compiled"

"""qcompile's own PT2E quantizer: whole CNNs int8 between the first quantize and the last
dequantize, and still within one step of PT2E per layer."""

from __future__ import annotations

import pytest

import calibration
from qcompile import zoo
from qcompile.accuracy.exactness import compare
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.passes.residency import residency
from qcompile.reference.program import ReferenceProgram


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_lite0", "digits_cnn"])
def test_qcompile_quantizer_keeps_cnns_int8(name):
    z = zoo.build(name)
    reader = calibration.get_reader(z.default_dataset)
    cal = list(reader.batches(z.spec, batch_size=4, num_batches=2, split="calibration"))
    q = quantize(z.module, z.example_inputs(2), cal, QuantizeConfig(quantizer="qcompile"))
    program = ReferenceProgram(q)
    res = residency(program.graph(4))
    assert res["int8_bytes_fraction"] >= 0.99, res["float_ops"]
    assert compare(program.graph(4), q.module, cal[0].inputs)["within_one_step_fraction"] == 1.0


def test_quantize_config__passes_float_residual_stream_to_the_quantizer():
    from torch import nn

    from qcompile.errors import RecipeError
    from qcompile.frontend.quantize import make_quantizer

    model = nn.Linear(2, 2)
    config = QuantizeConfig(quantizer="qcompile", float_residual_stream=True)
    assert make_quantizer(config, model).float_residual_stream
    with pytest.raises(RecipeError, match="float_residual_stream needs quantizer kind 'qcompile'"):
        make_quantizer(QuantizeConfig(float_residual_stream=True), model)

"""PT2E front end: export, quantize, op counts, and its user-facing errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qcompile.errors import ModelError, QuantizationError, RecipeError
from qcompile.frontend.quantize import (
    QuantizeConfig,
    count_quantized_ops,
    export_model,
    quantize,
)


def test_quantize_counts_ops_and_tracks_float(tiny_cnn, tiny_batches):
    q = quantize(tiny_cnn, tiny_batches[0], tiny_batches)
    assert q.quantized_ops["conv2d"] == 2 and q.quantized_ops["linear"] == 1
    assert q.calibration_batches == 4 and q.dynamic_batch
    x = tiny_batches[0][0]
    ref = tiny_cnn(x)
    got = q(x)
    assert torch.allclose(got, ref, atol=0.1 * ref.abs().max().item())


def test_quantized_model_runs_other_batch_sizes(tiny_cnn, tiny_batches):
    q = quantize(tiny_cnn, tiny_batches[0], tiny_batches)
    assert q(torch.randn(1, 3, 16, 16)).shape == (1, 10)
    assert q(torch.randn(7, 3, 16, 16)).shape == (7, 10)


def test_skip_keeps_module_in_float(tiny_cnn, tiny_batches):
    q = quantize(tiny_cnn, tiny_batches[0], tiny_batches, QuantizeConfig(skip=("fc",)))
    assert "linear" not in q.quantized_ops and q.quantized_ops["conv2d"] == 2


def test_unknown_skip_name_suggests_modules(tiny_cnn, tiny_batches):
    with pytest.raises(RecipeError, match=r"(?s)quantizer\.skip.*'convv1'.*conv1"):
        quantize(tiny_cnn, tiny_batches[0], tiny_batches, QuantizeConfig(skip=("convv1",)))


def test_nothing_quantized_is_an_error(tiny_batches):
    class NoLayers(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    with pytest.raises(QuantizationError, match="quantized nothing"):
        quantize(NoLayers(), tiny_batches[0], tiny_batches)


def test_skipping_everything_is_an_error(tiny_cnn, tiny_batches):
    with pytest.raises(QuantizationError, match=r"(?s)quantized nothing.*skip list: conv1"):
        quantize(tiny_cnn, tiny_batches[0], tiny_batches,
                 QuantizeConfig(skip=("conv1", "conv2", "fc")))


def test_empty_calibration_is_an_error(tiny_cnn, tiny_batches):
    with pytest.raises(QuantizationError, match="calibration saw no data"):
        quantize(tiny_cnn, tiny_batches[0], [])


def test_calibration_batch_of_wrong_shape(tiny_cnn, tiny_batches):
    bad = [(torch.randn(4, 3, 8, 8),)]
    with pytest.raises(QuantizationError, match=r"calibration batch 0, input 0: got "
                                                r"torch.float32\[4, 3, 8, 8\]"):
        quantize(tiny_cnn, tiny_batches[0], bad)


def test_unexportable_model_is_a_model_error(tiny_batches):
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow cannot be exported
                return self.fc(x.flatten(2)).sum(-1)
            return x

    with pytest.raises(ModelError, match=r"(?s)torch.export failed for DataDependent.*next:"):
        export_model(DataDependent(), tiny_batches[0])


def test_dropout_and_dead_code_do_not_reach_the_quantizer(tiny_batches):
    class WithDropout(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)
            self.drop = nn.Dropout(0.1)
            self.pooler = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc1(x)
            _ = self.pooler(h)  # computed, never used
            return self.fc2(self.drop(h)) + h

    x = (torch.randn(4, 16),)
    q = quantize(WithDropout().eval(), x, [x])
    names = {str(n.target) for n in q.module.graph.nodes}
    assert not any("dropout" in n for n in names)
    assert q.quantized_ops["linear"] == 2  # the pooler is gone, not quantized


def test_count_quantized_ops_on_plain_graph():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    assert count_quantized_ops(gm) == {}

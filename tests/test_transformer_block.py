"""A small post-LN transformer encoder (BERT's block: q/k/v projections, scaled scores, additive
padding mask, softmax, P·V, output projection, residual + layer norm, GELU FFN, residual + layer
norm) quantized with qcompile's quantizer: every layer norm, softmax, GELU, contraction and the
padding-mask add is integer from the input quantize to the output, and the reference, cpu, ort
and the Triton kernels (interpreted) give identical outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qcompile.accuracy.exactness import compare
from qcompile.codegen.ort.target import build as build_ort
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir.graph import Op
from qcompile.passes.residency import residency
from qcompile.reference import interpreter
from qcompile.reference.program import lower
from qcompile.zoo.bert import MASKED, SelfAttention

D, HEADS, FFN, LAYERS, SEQ, BATCH = 64, 4, 128, 2, 16, 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.attention_norm = SelfAttention(D, HEADS), nn.LayerNorm(D)
        self.ffn_in, self.ffn_out, self.ffn_norm = nn.Linear(D, FFN), nn.Linear(FFN, D), \
            nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, bias))
        return self.ffn_norm(x + self.ffn_out(nn.functional.gelu(self.ffn_in(x))))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * MASKED
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, 11:], mask[2, 4:] = 0, 0                      # two padded sequences
    return torch.randn(BATCH, SEQ, D, generator=g), mask


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [_batch(g) for _ in range(4)]
    q = quantize(Encoder().eval(), batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    return q, batches[1]


def test_encoder__whole_block_in_integers_close_to_pt2e(encoder):
    q, (x, mask) = encoder
    r = lower(q, BATCH)
    assert r.stats["int8-layer-norm"] == 2 * LAYERS and r.stats["int8-softmax"] == LAYERS
    assert r.stats["int8-mask-add"] == LAYERS
    assert r.stats["fuse-contraction-requant"] == 6 * LAYERS    # q, k, v, Q·Kᵀ, P·V, FFN in
    ops = {n.op for n in r.graph.nodes()}
    assert not ops & {Op.LAYER_NORM, Op.SOFTMAX, Op.GELU, Op.LINEAR, Op.MATMUL, Op.ADD}
    res = residency(r.graph)
    assert res["float_ops"] == [] and res["int8_bytes_fraction"] == 1.0
    got = interpreter.run(r.graph, x.numpy(), mask.numpy())[0]
    want = q(x, mask).numpy()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    # every int8 tensor, recomputed from PT2E's codes of its inputs: within one step
    vs_pt2e = compare(r.graph, q.module, (x, mask))
    assert vs_pt2e["within_one_step_fraction"] == 1.0, vs_pt2e["worst"]
    assert vs_pt2e["compared_tensors"] >= 8 * LAYERS


def _cpu_and_ort_equal_the_reference(q, x: torch.Tensor, mask: torch.Tensor) -> None:
    want = interpreter.run(lower(q, BATCH).graph, x.numpy(), mask.numpy())
    cpu = compile_cpu(q, CompileOptions(batch_sizes=(BATCH,), analyze=False))
    uk = cpu.report["compile"]["ukernel"]
    if uk["used"]:                     # each layer's attention is one fused dispatch
        assert uk["attention"] == LAYERS and not any(k.startswith("attention") for k in
                                                     uk["stock"])
        assert uk["table_epilogue"] == LAYERS      # GELU's table in FFN in's epilogue
    for got, w in zip(cpu.runner.modules[BATCH].module()(x.numpy(), mask.numpy()), want,
                      strict=True):
        np.testing.assert_array_equal(got.view(w.dtype), w)
    ort, _ = build_ort({BATCH: lower(q, BATCH).graph}, threads=1)
    for got, w in zip(ort.run_numpy(x.numpy(), mask.numpy()), want, strict=True):
        np.testing.assert_array_equal(got, w)


def _triton_equals_the_reference(q, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Interpreted Triton kernels; layer norms, softmax and mask lookups on the device."""
    pytest.importorskip("triton")
    from qcompile.codegen.triton.target import CudaOptions, compile_cuda

    model = compile_cuda(q, CompileOptions(batch_sizes=(BATCH,), analyze=False),
                         CudaOptions(interpret=True))
    host = [h["op"] for h in model.report["kernels"]["host_ops"]]
    assert "qlayernorm" not in host and "qsoftmax" not in host and "mask_lut" not in host
    program = model.runner.programs[BATCH]
    kernels = [s.launch.kernel for s in program.launches()]
    # each layer's attention is one fused kernel: no separate softmax or mask lookup
    assert kernels.count("attention") == LAYERS and "qsoftmax" not in kernels and \
        "mask_lut" not in kernels
    assert "lut" not in kernels                    # GELU's table in FFN in's epilogue
    got = program.run_numpy(x.numpy(), mask.numpy())
    want = interpreter.run(model.runner.graphs[BATCH], x.numpy(), mask.numpy())
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    from qcompile.codegen.triton import aot

    # and it compiles for sm_90 (tensor cores)
    step = next(s for s in program.launches() if s.launch.kernel == "attention")
    assert aot.compile_step(step, 90).int8_mma


def test_encoder__cpu_and_ort_equal_the_reference_bit_for_bit(encoder):
    q, (x, mask) = encoder
    _cpu_and_ort_equal_the_reference(q, x, mask)


def test_encoder__triton_kernels_equal_the_reference_bit_for_bit(encoder):
    q, (x, mask) = encoder
    _triton_equals_the_reference(q, x, mask)


@pytest.fixture(scope="module")
def float_stream_encoder():
    """The encoder quantized as MiniLM is: the residual stream (the sums before each layer norm
    and the layer norms' results) stays float."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [_batch(g) for _ in range(4)]
    with torch.no_grad():                          # an outlier feature, as real checkpoints have
        for b in batches:
            b[0][..., 3] *= 40.0
    config = QuantizeConfig(quantizer="qcompile", float_residual_stream=True)
    q = quantize(Encoder().eval(), batches[0], batches, config)
    return q, batches[1]


def test_float_residual_stream__layer_norms_in_integers_on_float_rows(float_stream_encoder):
    q, (x, mask) = float_stream_encoder
    lowered = lower(q, BATCH)
    norms = [n for n in lowered.graph.nodes() if n.op is Op.QLAYERNORM]
    assert len(norms) == 2 * LAYERS and all("code_bits" in n.attrs for n in norms)
    assert not [n for n in lowered.graph.nodes() if n.op is Op.LAYER_NORM]
    got = interpreter.run(lowered.graph, x.numpy(), mask.numpy())[0]
    want = q(x, mask).numpy()
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.99


def test_float_residual_stream__cpu_ort_and_triton_equal_the_reference(float_stream_encoder):
    q, (x, mask) = float_stream_encoder
    _cpu_and_ort_equal_the_reference(q, x, mask)
    _triton_equals_the_reference(q, x, mask)

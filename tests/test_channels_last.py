"""channels-last: QIR before/after, weights re-laid, layout changes only at the edges, and results
bit-identical to the pipeline without the pass (reference interpreter) on conv chains and CNNs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import calibration
from qcompile import zoo
from qcompile.accuracy.exactness import compare
from qcompile.frontend.importer import import_graph
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir.graph import Graph, Op
from qcompile.ir.parser import parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.verify import VerifyError, verify
from qcompile.passes.channels_last import ChannelsLast, pads_nhwc
from qcompile.passes.pipeline import default_pipeline, run_pipeline
from qcompile.reference import interpreter
from qcompile.reference.program import example_batch

CONV = "dilation=(1, 1), groups=1, layout='{}', padding=(0, 0), stride=(1, 1), x_zp=10"
RQ = ("rq(u8, terms=(term(zp=0, m=(1073741824, 1073741824)),), shift=(31, 32), zp=3, "
      "range=(0, 255), axis={})")
BEFORE = f"""graph @c {{
  %x = input() {{name='x'}} : u8[1,2,4,3]
  %w = const() {{value=array(i8, [2, 2, 2, 2], {list(range(-8, 8))})}} : i8[2,2,2,2]
  %b = const() {{value=array(i32, [2], [5, -5])}} : i32[2]
  %c = qconv2d(%x, %w, %b) {{{CONV.format('nchw')}}} : i32[1,2,3,2]
  %r = requant(%c) {{rq={RQ.format(1)}}} : u8[1,2,3,2]
  return %r
}}"""
OHWI = [-8, -4, -7, -3, -6, -2, -5, -1, 0, 4, 1, 5, 2, 6, 3, 7]   # w[o, i, h, w] -> w[o, h, w, i]
AFTER = f"""graph @c {{
  %x = input() {{name='x'}} : u8[1,2,4,3]
  %0 = permute(%x) {{dims=(0, 2, 3, 1), layout='nhwc'}} : u8[1,4,3,2]
  %1 = const() {{value=array(i8, [2, 2, 2, 2], {OHWI})}} : i8[2,2,2,2]
  %2 = const() {{value=array(i32, [2], [5, -5])}} : i32[2]
  %3 = qconv2d(%0, %1, %2) {{{CONV.format('nhwc')}}} : i32[1,3,2,2]
  %4 = requant(%3) {{rq={RQ.format(3)}}} : u8[1,3,2,2]
  %5 = permute(%4) {{dims=(0, 3, 1, 2), layout='nchw'}} : u8[1,2,3,2]
  return %5
}}"""


def test_channels_last__conv_requant_goes_nhwc_and_output_keeps_nchw():
    before = parse_graph(BEFORE)
    g, fired = ChannelsLast().run(before)
    assert fired == 2   # the conv and its requantize
    assert print_graph(g) == print_graph(parse_graph(AFTER))
    verify(g)
    x = np.random.default_rng(0).integers(0, 256, (1, 2, 4, 3)).astype(np.uint8)
    np.testing.assert_array_equal(interpreter.run(g, x)[0], interpreter.run(before, x)[0])


def test_channels_last__weights_are_ohwi():
    g, _ = ChannelsLast().run(parse_graph(BEFORE))
    conv = next(n for n in g.nodes() if n.op is Op.QCONV2D)
    oihw = parse_graph(BEFORE).outputs[0].src[0].src[1].attrs.value
    np.testing.assert_array_equal(conv.src[1].attrs.value, np.transpose(oihw, (0, 2, 3, 1)))


def test_channels_last__leaves_graph_without_int8_conv_alone():
    text = """graph @p {
  %x = input() {name='x'} : u8[1,2,4,4]
  %m = maxpool2d(%x) {kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1)} : u8[1,2,2,2]
  return %m
}"""
    g = parse_graph(text)
    out, fired = ChannelsLast().run(g)
    assert fired == 0 and out is g


def test_channels_last__second_run_does_nothing():
    g, _ = ChannelsLast().run(parse_graph(BEFORE))
    again, fired = ChannelsLast().run(g)
    assert fired == 0 and again is g


@pytest.mark.parametrize("pads, want", [((1, 2), (0, 0, 1, 2)), ((1, 2, 3, 4), (0, 0, 1, 2, 3, 4)),
                                         ((0, 0, 0, 0, 1, 1), (1, 1))])
def test_pads_nhwc(pads, want):
    assert pads_nhwc(pads) == want


def test_verifier_rejects_nhwc_conv_with_oihw_weights():
    text = BEFORE.replace("layout='nchw'", "layout='nhwc'")
    with pytest.raises(VerifyError, match="nhwc conv: .* disagree on channels"):
        verify(parse_graph(text))


# -- numeric: the pass changes layouts, never values ------------------------------------------

class Chain(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        groups = {"depthwise": 8, "grouped": 2}.get(kind, 1)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, stride=2 if kind == "strided" else 1,
                              padding=0 if kind == "pad" else 1, groups=groups)
        self.bn = nn.BatchNorm2d(8)
        self.mix = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 6)
        self.fc_flat = nn.Linear(8 * 6 * 6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        k = self.kind
        if k == "add":
            z = torch.relu(self.bn(self.conv(y)) + y)
        elif k == "pad":
            z = torch.relu(self.conv(nn.functional.pad(y, (1, 2, 0, 1))))
        elif k == "cat":
            z = self.mix(torch.cat([torch.relu(self.conv(y)), y], dim=1))
        elif k == "maxpool":
            z = nn.functional.max_pool2d(self.conv(y), 2)
        elif k == "avgpool":
            z = nn.functional.avg_pool2d(torch.relu(self.conv(y)), 2)
        elif k == "hardswish":
            z = nn.functional.hardswish(self.conv(y))
        elif k == "permute":   # the model's own move to NHWC, then a mean over H and W
            return self.fc(torch.relu(self.conv(y)).permute(0, 2, 3, 1).mean((1, 2)))
        elif k == "conv_out":  # a conv as the graph output: dequantized i32, per channel
            return self.conv(y)
        elif k == "flatten":   # a head that flattens C×H×W: needs NCHW order
            return self.fc_flat(torch.flatten(nn.functional.max_pool2d(self.conv(y), 2), 1))
        else:
            z = torch.relu(self.conv(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


KINDS = ["plain", "add", "depthwise", "grouped", "strided", "pad", "cat", "maxpool", "avgpool",
         "hardswish", "permute", "flatten", "conv_out"]


def lowered_both(q, batch: int) -> tuple[Graph, Graph]:  # type: ignore[no-untyped-def]
    """The default pipeline's graph, and the same without channels-last."""
    g = import_graph(q.module, example_batch(q, batch), name="model")
    without = tuple(p for p in default_pipeline() if not isinstance(p, ChannelsLast))
    return run_pipeline(g).graph, run_pipeline(g, without).graph


def permutes(g: Graph) -> list:  # type: ignore[type-arg]
    return [n for n in g.nodes() if n.op is Op.PERMUTE]


def assert_same_results(g: Graph, ref: Graph, inputs: tuple[torch.Tensor, ...]) -> None:
    x = [t.numpy() for t in inputs]
    for got, want in zip(interpreter.run(g, *x), interpreter.run(ref, *x), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_channels_last__chain_bit_identical(kind):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    q = quantize(Chain(kind).eval(), batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    cl, ref = lowered_both(q, 4)
    assert_same_results(cl, ref, batches[1])
    convs = [n for n in cl.nodes() if n.op is Op.QCONV2D]
    assert convs and all(n.attrs.layout == "nhwc" for n in convs)
    # one after the first quantize; one more where NCHW order is needed again
    assert len(permutes(cl)) == (2 if kind in ("flatten", "conv_out") else 1)
    assert compare(cl, q.module, batches[1])["within_one_step_fraction"] == 1.0
    if kind == "pad":
        pad = next(n for n in cl.nodes() if n.op is Op.PAD)
        assert pad.dtype.is_int8 and pad.attrs.pads == (0, 0, 1, 2, 0, 1)
    if kind == "conv_out":
        assert cl.outputs[0].op is Op.PERMUTE and cl.outputs[0].src[0].attrs.qp.axis == 3


def test_channels_last__one_permute_in_a_small_cnn(tiny_cnn, tiny_batches):
    q = quantize(tiny_cnn, tiny_batches[0], tiny_batches, QuantizeConfig(quantizer="qcompile"))
    cl, ref = lowered_both(q, 4)
    (perm,) = permutes(cl)
    assert perm.src[0].op is Op.QUANT and perm.attrs.dims == (0, 2, 3, 1)
    flatten = next(n for n in cl.nodes() if n.op is Op.RESHAPE)
    assert flatten.src[0].shape == (4, 1, 1, 8) and flatten.shape == (4, 8)   # H = W = 1
    assert_same_results(cl, ref, tiny_batches[1])


def test_channels_last__digits_cnn():
    z = zoo.build("digits_cnn")
    reader = calibration.get_reader(z.default_dataset)
    cal = list(reader.batches(z.spec, batch_size=8, num_batches=2, split="calibration"))
    q = quantize(z.module, z.example_inputs(2), cal, QuantizeConfig(quantizer="qcompile"))
    cl, ref = lowered_both(q, 8)
    assert_same_results(cl, ref, cal[0].inputs)
    assert not permutes(cl)   # one input channel: the move to NHWC is a reshape
    first, flatten = (n for n in cl.nodes() if n.op is Op.RESHAPE)
    assert first.src[0].op is Op.QUANT and first.shape == (8, 8, 8, 1)
    assert flatten.shape == (8, 64)
    assert compare(cl, q.module, cal[0].inputs)["within_one_step_fraction"] == 1.0


def test_channels_last__float_output_permute_is_reported_as_layout_change():
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 12, 12),)
    q = quantize(Chain("conv_out").eval(), x, [x], QuantizeConfig(quantizer="qcompile"))
    g = run_pipeline(import_graph(q.module, example_batch(q, 2), name="model")).graph
    (out,) = g.outputs
    assert out.op is Op.PERMUTE and out.dtype.is_float
    assert out.attrs.fallback.startswith("channels-last: the float result of an NHWC chain")

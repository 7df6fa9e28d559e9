"""The why-not-faster report: float MACs, float islands, quantize/dequantize left, chain lengths
and bytes moved, with findings in words; ``qcompile inspect --why-not-faster``."""

from __future__ import annotations

from pathlib import Path

import torch
from test_reference import Chain
from typer.testing import CliRunner

from qcompile.cli import app
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.passes.why_not_faster import why_not_faster
from qcompile.reference.program import lower

RECIPES = Path(__file__).parent.parent / "recipes"


def _report(config: QuantizeConfig, kind: str = "add_relu"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    q = quantize(Chain(kind).eval(), batches[0], batches, config)
    return why_not_faster(lower(q, 4).graph)


def test_all_int8_graph__nothing_in_the_way():
    r = _report(QuantizeConfig(quantizer="qcompile"))
    assert r["int8_mac_fraction"] == 1.0 and r["float_islands"] == []
    assert r["conversions"] == {"at_edges": 2, "inside": 0, "inside_at": []}
    assert len(r["chains"]["segments"]) == 1 and r["chains"]["count"] == 4
    b = r["bytes_moved"]
    assert set(b["activations"]) == {"u8", "f32"} and b["fraction_of_f32"] < 0.35
    assert r["findings"][0].startswith("nothing in the graph stands in the way")


def test_float_islands_and_conversions__found_and_explained():
    r = _report(QuantizeConfig(quantizer="x86"))     # x86 leaves the residual add in float
    (island,) = r["float_islands"]
    assert island["ops"][:3] == ["permute", "add", "relu"]
    assert any("add output is not quantized" in why for why in island["reasons"])
    assert r["conversions"]["inside"] == 3 and len(r["chains"]["segments"]) == 2
    assert any(f.startswith("float island of 5 op(s)") for f in r["findings"])
    assert any("quantize/dequantize conversion(s) inside" in f for f in r["findings"])


def test_skipped_layer__float_multiply_accumulates_named():
    r = _report(QuantizeConfig(quantizer="qcompile", skip=("fc",)))
    assert 0.99 < r["int8_mac_fraction"] < 1.0
    (fc,) = r["float_contractions"]
    assert fc["op"] == "linear" and fc["macs"] == 4 * 6 * 8
    assert r["findings"][0].startswith(f"{100 * (1 - r['int8_mac_fraction']):.1f} % of "
                                       "multiply-accumulates run in float")


def test_inspect__prints_the_report():
    result = CliRunner().invoke(app, ["inspect", str(RECIPES / "digits_cnn.yaml"),
                                      "--why-not-faster"])
    assert result.exit_code == 0, result.output
    assert "why not faster:" in result.output and "int8 MACs: 100.00 %" in result.output
    assert "bytes moved" in result.output

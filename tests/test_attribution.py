"""Per-chain attribution: every fused chain's SQNR against the float model and PT2E, matched
through fusion (and folded batch norms) by FX name; a compiler error in one chain is named as
such; the report carries it (report.json, report.md, attribution.png) and so does
``qcompile inspect --accuracy``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from test_reference import Chain
from tiny_models import TinyCNN
from typer.testing import CliRunner

from qcompile.accuracy.attribution import attribution
from qcompile.cli import app
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir.graph import Graph, Node, Op
from qcompile.ir.types import Term
from qcompile.passes.base import Context, RewritePass
from qcompile.passes.residency import residency
from qcompile.pipeline import run_recipe, write_outputs
from qcompile.recipe import load_recipe
from qcompile.reference.program import lower

RECIPES = Path(__file__).parent.parent / "recipes"


def _quantized(model: torch.nn.Module, shape: tuple[int, ...], config: QuantizeConfig):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(*shape, generator=g),) for _ in range(3)]
    return quantize(model, batches[0], batches, config), batches[1]


def test_every_chain__measured_against_float_and_pt2e():
    torch.manual_seed(0)
    q, x = _quantized(TinyCNN().eval(), (4, 3, 16, 16), QuantizeConfig(quantizer="qcompile"))
    graph = lower(q, 4).graph
    a = attribution(graph, q, x)
    rows = a["chains"]
    assert [r["loc"] for r in rows] == [c["loc"] for c in residency(graph)["chains"]]
    for r in rows:
        assert r["sqnr_vs_float_db"] > 30 and r["sqnr_vs_pt2e_db"] > r["sqnr_vs_float_db"], r
        assert r["sqnr_vs_pt2e_local_db"] >= min(r["sqnr_vs_pt2e_db"], 60.0), r
        assert abs(r["pt2e_sqnr_vs_float_db"] - r["sqnr_vs_float_db"]) < 1.0, r
        assert r["dominant"] == "quantization"
    assert rows[0]["matched"].startswith("quantize_per_tensor")   # conv+bn+relu -> its quantize
    assert rows[-1]["ops"] == ["qlinear", "dequant"] and rows[-1]["matched"] == "linear"
    assert a["compiler_dominated"] == 0


def test_conv_with_folded_batch_norm__matched_to_the_float_batch_norm_output():
    """x86 leaves conv+bn feeding a float add: the chain ends in a dequantize named after the
    conv, whose float counterpart is the batch norm PT2E folded into it."""
    torch.manual_seed(0)
    q, x = _quantized(Chain("add_relu").eval(), (4, 3, 12, 12), QuantizeConfig(quantizer="x86"))
    rows = attribution(lower(q, 4).graph, q, x)["chains"]
    (conv_bn,) = [r for r in rows if r["ops"] == ["qconv2d", "dequant"]]
    assert conv_bn["sqnr_vs_float_db"] > 30, conv_bn


class _BreakOneRequant(RewritePass):
    """A simulated compiler bug: the second requantize's multipliers 10 % too large."""

    name = "break-one-requant"

    def __init__(self) -> None:
        self.seen = 0

    def rule(self, n: Node, ctx: Context) -> Node | None:
        if n.op is not Op.REQUANT or n.attrs.get("broken"):
            return None
        self.seen += 1
        if self.seen != 2:
            return None
        rq = n.attrs.rq
        terms = tuple(Term(t.zero_point, tuple(int(m * 1.1) for m in t.multiplier))
                      for t in rq.terms)
        return n.with_(attrs=n.attrs.replace(rq=type(rq)(terms, *_rest(rq)), broken=True))


def _rest(rq):  # type: ignore[no-untyped-def]
    return rq.shift, rq.zp_out, rq.qmin, rq.qmax, rq.out_dtype, rq.axis


def test_compiler_error_in_one_chain__is_named_a_compiler_error():
    torch.manual_seed(0)
    q, x = _quantized(TinyCNN().eval(), (4, 3, 16, 16), QuantizeConfig(quantizer="qcompile"))
    graph: Graph = _BreakOneRequant().run(lower(q, 4).graph)[0]
    rows = attribution(graph, q, x)["chains"]
    assert rows[0]["dominant"] == "quantization"
    assert rows[1]["dominant"] == "compiler" and rows[1]["sqnr_vs_pt2e_local_db"] < 25, rows[1]
    # PT2E's own error is unchanged: the drop is the compiler's
    assert rows[1]["pt2e_sqnr_vs_float_db"] > 30


def test_digits_cnn_report__attribution_in_json_markdown_and_png(tmp_path):
    report = run_recipe(load_recipe(RECIPES / "digits_cnn.yaml"), targets=["reference"])
    a = report["targets"]["reference"]["attribution"]
    assert len(a["chains"]) == report["residency"]["chain_count"] == 5
    assert all(r["sqnr_vs_float_db"] is not None and r["sqnr_vs_pt2e_db"] is not None
               for r in a["chains"])
    assert a["worst_vs_float"]["sqnr_vs_float_db"] > 30
    _, md = write_outputs(report, tmp_path)
    text = md.read_text()
    assert "## Per-chain attribution (reference" in text and "features.0" in text
    png = (tmp_path / "attribution.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_inspect_accuracy__prints_the_per_chain_table():
    result = CliRunner().invoke(app, ["inspect", str(RECIPES / "digits_cnn.yaml"), "--accuracy"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "qconv2d+requant" in ln and "->" in ln
             and "quantize_per_tensor" in ln]
    assert len(lines) == 3
    assert "per-chain attribution on 64 evaluation inputs" in result.output
    assert np.isfinite(float(lines[0].split()[1]))

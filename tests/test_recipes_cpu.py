"""Target cpu end to end: recipes on the zoo models (bit-exact with the reference, thresholds,
single-dispatch chains), artifacts saved and loaded, the compile/exec commands."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import qcompile
from qcompile.cli import app
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.errors import ArtifactError
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.pipeline import run_recipe
from qcompile.recipe import load_recipe
from qcompile.runtime import artifact

RECIPES = Path(__file__).parent.parent / "recipes"
cli = CliRunner()


class ProjectionBlock(nn.Module):
    """A ResNet block whose shortcut is a strided 1×1 conv (two contractions into one add), then a
    classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 1, stride=2)
        self.fc = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x):
        y = torch.relu(self.b(torch.relu(self.a(x))) + self.down(x))
        return self.fc(torch.flatten(y, 1))


def projection_block_model():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 8, 8, 8, generator=g),) for _ in range(3)]
    q = quantize(ProjectionBlock().eval(), batches[0], batches,
                 QuantizeConfig(quantizer="qcompile"))
    return q, batches[1][0]


def _cpu_report(name: str) -> dict:
    report = run_recipe(load_recipe(RECIPES / f"{name}.yaml"), targets=["cpu"])
    cpu = report["targets"]["cpu"]
    assert cpu["status"] == "ok", cpu.get("reason")
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0, cpu["exactness"]["vs_reference"]
    assert set(cpu["exactness"]["vs_reference"]["per_batch"]) >= {"1", "8"}
    assert cpu["accuracy"]["passed"], [c for c in cpu["accuracy"]["checks"] if not c["passed"]]
    return cpu


@pytest.mark.parametrize("name", ["digits_cnn", "resnet18"])
def test_cnn_recipe_on_cpu__bit_exact_thresholds_single_dispatch_chains(name):
    cpu = _cpu_report(name)
    assert cpu["kernels"]["max_per_chain"] == 1
    assert cpu["kernels"]["i32_writes"] == 0
    assert cpu["latency_ms"]["cpu"] > 0 and cpu["latency_ms"]["speedup_vs_eager_fp32"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "efficientnet_lite0"])
def test_slow_cnn_recipe_on_cpu(name):
    cpu = _cpu_report(name)
    # the logits chain too (f32 out of the microkernel; stock, it is two at batch 1)
    assert cpu["kernels"]["max_per_chain"] == (1 if cpu["compile"]["ukernel"]["used"] else 2)


@pytest.mark.slow
def test_minilm_recipe_on_cpu__bit_exact_with_its_float_residual_stream():
    report = run_recipe(load_recipe(RECIPES / "minilm.yaml"), targets=["cpu"])
    cpu = report["targets"]["cpu"]
    assert cpu["status"] == "ok", cpu.get("reason")
    assert cpu["accuracy"]["passed"]
    # the residual stream stays float, but its layer norms run in integers (codes of each row's
    # power-of-two scale), its dequantizes are exact products by a power of two (so LLVM's
    # multiply-add contraction changes nothing) and the pooling sums int8 values in i32: the
    # output is identical to the reference's
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0
    assert cpu["passes"]["int8-layer-norm"] == 13
    uk = cpu["compile"]["ukernel"]
    if uk["used"]:       # the projections into the float stream: f32 out, residual add fused
        assert uk["float_epilogue"] == uk["float_residual_adds"] == 12 and uk["stock"] == {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    q, x = projection_block_model()
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 2), analyze=False))
    path = model.save(tmp_path_factory.mktemp("art") / "block.qca")
    return model, path, x


def test_artifact__round_trip_is_bit_identical(saved):
    model, path, x = saved
    loaded = qcompile.load(path)
    for n in (1, 2, 3):
        assert torch.equal(loaded(x[:n].repeat(2, 1, 1, 1)[:n]), model(x[:n].repeat(2, 1, 1,
                                                                                      1)[:n]))
    assert loaded.signature == model.signature


def _rewrite(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members = edit(members)
    with zipfile.ZipFile(dst, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    return dst


def _meta_edit(**changes):  # type: ignore[no-untyped-def]
    def edit(m):  # type: ignore[no-untyped-def]
        meta = json.loads(m["meta.json"])
        meta.update(changes)
        return {**m, "meta.json": json.dumps(meta).encode()}
    return edit


def _flip_module_byte(m):  # type: ignore[no-untyped-def]
    name = next(n for n in m if n.endswith(".vmfb"))
    data = bytearray(m[name])
    data[len(data) // 2] ^= 0xFF
    return {**m, name: bytes(data)}


@pytest.mark.parametrize("edit, message", [
    (lambda m: {k: v for k, v in m.items() if k != "meta.json"}, "missing member"),
    (_meta_edit(format_version=99), "format version 99"),
    (_meta_edit(target="cuda"), "for target 'cuda'"),
    (_meta_edit(host="arm64:other"), "compiled for another machine"),
    (_meta_edit(format="zip"), "not a qcompile artifact"),
    (_flip_module_byte, "does not match its checksum"),
    (lambda m: {**m, "meta.json": b"{not json"}, "unreadable"),
    (_meta_edit(modules={"b1.vmfb": {"batch": 1}}), "lists its modules wrongly"),
], ids=["no-meta", "version", "target", "host", "format", "bit-flip", "bad-json", "bad-modules"])
def test_artifact__damaged_is_refused_before_running(saved, tmp_path, edit, message):
    _, path, _ = saved
    bad = _rewrite(path, tmp_path / "bad.qca", edit)
    with pytest.raises(ArtifactError, match=message):
        artifact.load(bad)


def test_artifact__truncated_or_missing(saved, tmp_path):
    _, path, _ = saved
    cut = tmp_path / "cut.qca"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="corrupt"):
        artifact.load(cut)
    with pytest.raises(ArtifactError, match="not found"):
        artifact.load(tmp_path / "none.qca")


def test_artifact__only_cpu_models_save(tmp_path):
    q, _ = projection_block_model()
    with pytest.raises(ArtifactError, match="cannot save a 'pt2e' model"):
        qcompile.compile(q, "pt2e").save(tmp_path / "x.qca")


def test_cli_compile_then_exec(tmp_path):
    out = tmp_path / "digits.qca"
    result = cli.invoke(app, ["compile", str(RECIPES / "digits_cnn.yaml"), "-o", str(out), "-b",
                              "1", "-b", "4", "-q"])
    assert result.exit_code == 0, result.output
    x = np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    result = cli.invoke(app, ["exec", str(out), "-i", str(tmp_path / "x.npy"), "-o",
                              str(tmp_path / "y.npz")])
    assert result.exit_code == 0, result.output
    y = np.load(tmp_path / "y.npz")["output_0"]
    assert y.shape == (5, 10)
    np.testing.assert_array_equal(y, qcompile.load(out)(torch.from_numpy(x)).numpy())
    wrong = tmp_path / "w.npy"
    np.save(wrong, x[:, :, :4])
    result = cli.invoke(app, ["exec", str(out), "-i", str(wrong), "-o", str(tmp_path / "z.npz")])
    assert result.exit_code == 2 and "does not fit the compiled model" in result.output
    assert not (tmp_path / "z.npz").exists()


@pytest.mark.slow
def test_minilm_word_similarity_on_cpu__task_metric_holds():
    report = run_recipe(load_recipe(RECIPES / "minilm_word_similarity.yaml"), targets=["cpu"])
    cpu = report["targets"]["cpu"]
    assert cpu["status"] == "ok", cpu.get("reason")
    acc = cpu["accuracy"]
    assert acc["compare"]["pairs"] == 499 and acc["passed"], acc["checks"]
    assert acc["float"]["spearman"] > 0.3 and abs(acc["float"]["spearman"] -
                                                  acc["int8"]["spearman"]) < 0.03
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0      # as minilm


@pytest.mark.slow
def test_bert_encoder_on_cpu__bit_exact_with_int8_layer_norms_and_masks():
    report = run_recipe(load_recipe(RECIPES / "bert_encoder.yaml"), targets=["cpu"])
    cpu = report["targets"]["cpu"]
    assert cpu["status"] == "ok", cpu.get("reason")
    assert cpu["accuracy"]["passed"], cpu["accuracy"]["checks"]
    # every layer norm and attention-mask add runs in integers (the last layer norm converts its
    # result to float once): the output is identical
    assert cpu["exactness"]["vs_reference"]["mismatched"] == 0
    assert cpu["passes"]["int8-layer-norm"] == 9 and cpu["passes"]["int8-mask-add"] == 4
    inside = [f["op"] for f in cpu["residency"]["float_ops"] if f["region"] == "inside"]
    assert inside == ["add"]           # word + position embeddings, before the first quantize

"""Target cuda (QIR → Triton), checked without a GPU.

(a) The kernels run in Triton's CPU interpreter and must equal the reference interpreter bit for
bit: the chain table, hand-built graphs for the ops the zoo CNNs do not reach (batched matmul
with both zero points, broadcast mul, int8 add, per-channel quantize, ...) and digits_cnn.
(b) The same launches compile ahead of time for sm_80 and sm_90; the PTX must hold the int8
tensor-core instructions (``mma.sync ... .s8`` on sm_80, ``wgmma.mma_async ... .s8`` on sm_90).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_reference import KINDS, Chain

import calibration
from qcompile import zoo
from qcompile.codegen.target import CompileOptions
from qcompile.codegen.triton import aot, loader
from qcompile.codegen.triton.lower import lower_graph
from qcompile.codegen.triton.target import CudaOptions, compile_cuda, unavailable_reason
from qcompile.codegen.triton.tiles import gemm_tile
from qcompile.errors import TargetUnavailableError
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.ir import qmath
from qcompile.ir.graph import ANCHOR_OPS, Graph, Node, Op, node
from qcompile.ir.types import DType, QParams
from qcompile.reference import interpreter
from qcompile.reference.program import lower

INTERPRET = CudaOptions(interpret=True)
CPU = torch.device("cpu")


def _quantized(kind: str, config: QuantizeConfig | None = None):
    torch.manual_seed(0)
    model = Chain(kind).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    return quantize(model, batches[0], batches, config or QuantizeConfig(quantizer="qcompile")), \
        batches[1][0]


def _chains(graph: Graph) -> int:
    return sum(n.op in (Op.REQUANT, Op.DEQUANT) and n.src[0].op in ANCHOR_OPS
               for n in graph.nodes())


def _compile(q, sizes=(1, 4), conv="auto"):
    return compile_cuda(q, CompileOptions(batch_sizes=sizes, analyze=False),
                        CudaOptions(interpret=True, conv=conv))


def _assert_exact(model, x: torch.Tensor) -> None:
    """Every compiled batch size: interpreted kernels vs the reference interpreter."""
    for b, program in model.runner.programs.items():
        graph = model.runner.graphs[b]
        got = program.run_numpy(x[:b].numpy())
        for g, w in zip(got, interpreter.run(graph, x[:b].numpy()), strict=True):
            np.testing.assert_array_equal(g, w)


# -- (a) bit-exact under TRITON_INTERPRET ----------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_chain__interpreted_kernels_equal_reference_bit_for_bit(kind):
    q, x = _quantized(kind)
    model = _compile(q)
    _assert_exact(model, x)
    k = model.report["kernels"]
    assert k["host_ops"] == [] and k["max_per_chain"] == 1
    assert k["fused_chains"] == _chains(lower(q, 4).graph) >= 3      # one kernel per chain
    ref = lower(q, 1).graph                                           # 3 = pieces of 1
    want = np.concatenate([interpreter.run(ref, x[i:i + 1].numpy())[0] for i in range(3)])
    np.testing.assert_array_equal(model(x[:3]).numpy(), want)


@pytest.mark.parametrize("conv", ["igemm", "direct"])
@pytest.mark.parametrize("kind", ["depthwise", "grouped", "strided"])
def test_grouped_and_strided_convs__both_algorithms_exact(kind, conv):
    q, x = _quantized(kind)
    model = _compile(q, sizes=(4,), conv=conv)
    _assert_exact(model, x)
    kernels = model.report["kernels"]["by_kernel"]
    assert f"conv2d_{conv}" in kernels and "conv2d_" + {"igemm": "direct", "direct": "igemm"}[
        conv] not in kernels


@pytest.mark.parametrize("config", [
    QuantizeConfig(quantizer="x86"),                                            # float islands
    QuantizeConfig(quantizer="qcompile", activations="per_tensor_symmetric"),   # s8 activations
    QuantizeConfig(quantizer="qcompile", weights="per_tensor_symmetric"),
], ids=["x86-float-islands", "int8-activations", "per-tensor-weights"])
def test_chain_variants__exact(config):
    q, x = _quantized("add_relu", config)
    model = _compile(q, sizes=(4,))
    _assert_exact(model, x)
    host = model.report["kernels"]["host_ops"]
    assert bool(host) == (config.quantizer == "x86")      # float islands run on the host
    assert all(h["reason"] for h in host)


def _qp(dtype: DType, zp: int, scale: float = 1.0) -> QParams:
    lo, hi = dtype.range
    return QParams(dtype, (scale,), (zp,), lo, hi)


def _const(value: np.ndarray) -> Node:
    return node(Op.CONST, DType.of_numpy(value.dtype), value.shape, value=value)


def _handmade_graph() -> tuple[Graph, list[np.ndarray]]:
    """Ops and forms the zoo CNNs do not reach: a batched u8 x s8 matmul with both zero points
    and a broadcast batch; a per-channel quantize of exact ties; a broadcast int8 mul and a
    two-term int8 add; a lut; sums over inner dims without keepdim; a linear on 4-D u8 input
    into a per-channel dequantize; permute, cat and pad into an s8 strided conv whose
    accumulator has two readers (stored as i32, then requantized and dequantized)."""
    rng = np.random.default_rng(0)
    u8, i8, i32, f32 = DType.U8, DType.I8, DType.I32, DType.F32
    a = node(Op.INPUT, u8, (2, 3, 20, 40), name="a")
    b = node(Op.INPUT, i8, (1, 40, 24), name="b")
    f = node(Op.INPUT, f32, (2, 3, 5, 8), name="f")
    mm = node(Op.QMATMUL, i32, (2, 3, 20, 24), a, b, a_zp=131, b_zp=-3)
    mm_q = _requant([mm], [[5e-4]], [0], _qp(u8, 128))
    fq = node(Op.QUANT, i8, f.shape, f, qp=QParams(i8, (0.25, 0.5, 0.125), (0, 3, -2), -128,
                                                    127, axis=1))
    mul = node(Op.QMUL, i32, f.shape, fq, _const(rng.integers(-128, 128, (1, 3, 1, 8), np.int8)),
               a_zp=1, b_zp=5)
    mul_q = _requant([mul], [[0.004]], [0], _qp(i8, 0))
    added = _requant([mul_q, fq], [[0.7], [0.3]], [0, 3], _qp(i8, -4))
    table = rng.integers(-128, 128, 256).astype(np.int8)
    hw = node(Op.PERMUTE, i8, (2, 5, 8, 3), node(Op.LUT, i8, f.shape, added, table=table),
              dims=(0, 2, 3, 1))
    sums = node(Op.QSUM, i32, (2, 3, 5), node(Op.RESHAPE, u8, (2, 3, 5, 4, 24), mm_q,
                                                shape=(2, 3, 5, 4, 24)),
                dims=(3, 4), keepdim=False, x_zp=128)
    col = node(Op.PERMUTE, i8, (2, 5, 1, 3), node(Op.RESHAPE, i8, (2, 3, 5, 1), _requant(
        [sums], [[0.1]], [0], _qp(i8, 9)), shape=(2, 3, 5, 1)), dims=(0, 2, 3, 1))
    img = node(Op.PAD, i8, (2, 7, 11, 3), node(Op.CAT, i8, (2, 5, 9, 3), hw, col, axis=2),
               pads=(0, 0, 1, 1, 0, 2), value=-4)
    conv = node(Op.QCONV2D, i32, (2, 4, 6, 4), img, _const(rng.integers(-128, 128, (4, 3, 3, 3),
                                                                      np.int8)),
                _const(rng.integers(-900, 900, 4, np.int32)), stride=(2, 2), padding=(1, 1),
                dilation=(1, 1), groups=1, x_zp=-4, layout="nhwc")
    conv_q = _requant([conv], [np.linspace(1e-3, 3e-3, 4)], [0], _qp(u8, 3), axis=3)
    conv_f = node(Op.DEQUANT, f32, conv.shape, conv, qp=QParams(i32, (2e-3,), (0,), -2**31,
                                                                 2**31 - 1))
    lin = node(Op.QLINEAR, i32, (2, 3, 20, 6), mm_q,
               _const(rng.integers(-128, 128, (6, 24), np.int8)),
               _const(rng.integers(-500, 500, 6, np.int32)), x_zp=128)
    lin_f = node(Op.DEQUANT, f32, lin.shape, lin, qp=QParams(
        i32, tuple(rng.uniform(1e-4, 1e-3, 6)), (0,) * 6, -2**31, 2**31 - 1, axis=3))
    ties = (np.arange(240, dtype=np.float32).reshape(f.shape) - 120.0) * 0.5 * \
        np.array([0.25, 0.5, 0.125], dtype=np.float32).reshape(1, 3, 1, 1)
    inputs = [rng.integers(0, 256, a.shape, np.uint8), rng.integers(-128, 128, b.shape, np.int8),
              ties]
    return Graph("handmade", (a, b, f), (mm_q, lin_f, conv_q, conv_f)), inputs


def _requant(srcs, reals, zps, out: QParams, axis=None) -> Node:
    return node(Op.REQUANT, out.dtype, srcs[0].shape, *srcs,
                rq=qmath.make_requant(reals, zps, out, axis=axis))


def test_handmade_graph__every_op_form_exact():
    graph, inputs = _handmade_graph()
    program = lower_graph(graph, loader.kernels(True), CPU)
    for got, want in zip(program.run_numpy(*inputs), interpreter.run(graph, *inputs),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    summary = program.summary()
    assert summary["host_ops"] == []
    assert summary["by_kernel"]["conv2d_igemm"] == 1 and summary["by_kernel"]["gemm"] == 2
    assert {"quantize", "requant_flat", "sum_rows"} <= set(summary["by_kernel"])
    # the table reads the int8 add's requantize only: that kernel stores the table's entries
    assert "lut" not in summary["by_kernel"]
    assert [s.label for s in program.launches() if s.launch.consts.get("EPI") == 3] == \
        ["requant+lut"]


@pytest.fixture(scope="module")
def digits():
    z = zoo.build("digits_cnn")
    reader = calibration.get_reader(z.default_dataset)
    cal = list(reader.batches(z.spec, batch_size=8, num_batches=2, split="calibration"))
    q = quantize(z.module, z.example_inputs(2), cal, QuantizeConfig(quantizer="qcompile"))
    return q, cal[1].inputs[0]


def test_digits_cnn__interpreted_kernels_equal_reference(digits):
    q, x = digits
    model = _compile(q, sizes=(1, 8))
    _assert_exact(model, x)
    k = model.report["kernels"]
    assert model.report["mode"] == "triton-interpreter"
    assert k["host_ops"] == [] and k["fused_chains"] == 5       # 3 convs, pool+mean, fc
    assert k["by_kernel"] == {"conv2d_igemm": 3, "gemm": 1, "maxpool2d": 1, "quantize": 1,
                              "sum_rows": 1}
    assert model.report["residency"]["int8_bytes_fraction"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_zoo_cnn_at_batch_1__interpreted_kernels_equal_reference(name):
    """224x224 models: 128-row tiles, K up to 4608, residual epilogues, the 7x7 stem, padded
    max pool, depthwise convs (about a minute each in the interpreter)."""
    z = zoo.build(name)
    reader = calibration.get_reader(z.default_dataset)
    cal = list(reader.batches(z.spec, batch_size=4, num_batches=1, split="calibration"))
    q = quantize(z.module, z.example_inputs(1), cal, QuantizeConfig(quantizer="qcompile"))
    model = _compile(q, sizes=(1,))
    _assert_exact(model, cal[0].inputs[0][:1])
    assert model.report["kernels"]["host_ops"] == []


@pytest.mark.slow
def test_minilm__interpreted_kernels_equal_reference():
    """Real MiniLM weights, its float residual stream and integer layer norms on it: the
    kernels (layer norms on float rows, dequantize epilogues into the float stream, attention,
    GELU tables) equal the reference; the float adds and the pooling stay on the host."""
    z = zoo.build("minilm", seq_len=16)
    reader = calibration.get_reader("sentences")
    cal = list(reader.batches(z.spec, batch_size=8, num_batches=2, split="calibration"))
    config = QuantizeConfig(quantizer="qcompile", float_residual_stream=True, method="minmax")
    q = quantize(z.module, cal[0].inputs, [b.inputs for b in cal], config)
    model = _compile(q, sizes=(2,))
    assert "qlayernorm" not in [h["op"] for h in model.report["kernels"]["host_ops"]]
    x = [t[:2].numpy() for t in cal[1].inputs]
    got = model.runner.programs[2].run_numpy(*x)
    for g, w in zip(got, interpreter.run(model.runner.graphs[2], *x), strict=True):
        np.testing.assert_array_equal(g, w)


# -- (b) ahead-of-time compile for sm_80 / sm_90, no GPU ---------------------------------------

def _contraction_steps(graph: Graph):
    program = lower_graph(graph, loader.kernels(False), CPU)
    return [s for s in program.launches() if s.launch.kernel in ("conv2d_igemm", "gemm")]


@pytest.mark.parametrize("arch", [80, 90])
def test_aot__digits_cnn_contractions_use_int8_tensor_cores(digits, arch, triton_cache):
    q, _ = digits
    steps = _contraction_steps(lower(q, 8).graph)
    assert [s.launch.kernel for s in steps] == ["conv2d_igemm"] * 3 + ["gemm"]
    for step in steps:
        c = aot.compile_step(step, arch)
        assert c.mma_sync_s8 if arch == 80 else c.int8_mma, (step.label, c.mma)
        # wgmma needs a 64-row warp-group tile: the batch-8 fc (M = 8, BM = 16) uses mma.sync
        if arch == 90:
            assert c.wgmma_s8 == (step.launch.consts["BM"] >= 64), (step.label, c.mma)
        assert all(".s32.s8.s8" in op for op in c.mma)


def _conv_graph(batch: int, hw: int, c: int, f: int) -> Graph:
    """One 3x3 u8 conv (NHWC) + requantize: a resnet stage shape."""
    rng = np.random.default_rng(1)
    x = node(Op.INPUT, DType.U8, (batch, hw, hw, c), name="x")
    conv = node(Op.QCONV2D, DType.I32, (batch, hw, hw, f), x,
                _const(rng.integers(-128, 128, (f, 3, 3, c), np.int8)),
                _const(np.zeros(f, np.int32)), stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                groups=1, x_zp=3, layout="nhwc")
    out = _requant([conv], [np.full(f, 1e-3)], [0], _qp(DType.U8, 0), axis=3)
    return Graph("conv", (x,), (out,))


def test_aot__large_tiles_emit_wgmma_on_sm90_and_mma_sync_on_sm80(triton_cache):
    (step,) = _contraction_steps(_conv_graph(1, 56, 64, 64))     # M 3136, N 64, K 576
    assert step.launch.tile == gemm_tile(3136, 64, 576).describe() == "128x64x128 w4 s3"
    sm80, sm90 = aot.compile_step(step, 80), aot.compile_step(step, 90)
    assert list(sm80.mma) == ["mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"]
    assert list(sm90.mma) == ["wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8"]
    assert "cp.async" in sm80.ptx                                    # pipelined loads


TILE_CONSTS = {"BM", "BN", "BK", "BC", "BLOCK", "BR", "BI"}


def test_aot__every_launch_form_compiles(triton_cache):
    """Compiled mode is not the interpreter: every kernel in every epilogue form that the
    hand-built graph and the depthwise and max-pool chains launch must compile for sm_90."""
    graphs = [_handmade_graph()[0], *(lower(_quantized(k)[0], 2).graph
                                      for k in ("depthwise", "maxpool"))]
    steps = [s for g in graphs for s in lower_graph(g, loader.kernels(False), CPU).launches()]
    forms: dict[tuple, object] = {}
    for step in steps:
        consts = tuple(sorted((k, v) for k, v in step.launch.consts.items()
                              if k not in TILE_CONSTS))
        forms.setdefault((step.launch.kernel, consts), step)
    kernels = {k for k, _ in forms}
    assert kernels == {"conv2d_igemm", "conv2d_direct", "gemm", "maxpool2d", "quantize",
                       "requant_flat", "sum_rows"}
    assert any(dict(c).get("EPI") == 3 for _, c in forms)       # a requantize + table
    for step in forms.values():
        assert ".entry" in aot.compile_step(step, 90).ptx


def test_tiles__every_rule_gives_tensor_core_shapes():
    for m in (1, 8, 63, 64, 200, 3136, 100352):
        for n in (1, 10, 16, 64, 1000):
            for k in (9, 27, 64, 576, 4608):
                t = gemm_tile(m, n, k)
                assert t.bm >= 16 and t.bn >= 16 and t.bk >= 32 and t.warps in (4, 8)
                assert t.bm <= max(16, 2 * m) and t.bn <= max(16, 2 * n)


# -- availability: no GPU here is a clear message, not a traceback ----------------------------

def test_loader__compiled_and_interpreted_kernels_in_one_process():
    before = os.environ.get("TRITON_INTERPRET")
    loader.kernels.cache_clear()
    compiled, interpreted = loader.kernels(False), loader.kernels(True)
    assert type(compiled.gemm).__name__ == type(compiled._epilogue).__name__ == "JITFunction"
    assert type(interpreted.gemm).__name__ == type(interpreted._epilogue).__name__ == \
        "InterpretedFunction"
    assert os.environ.get("TRITON_INTERPRET") == before        # the knob was only scoped


def test_unavailable_without_gpu__says_why_and_how_to_check_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = unavailable_reason()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        assert reason is None
        return
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    assert "no CUDA" in reason or "sm_80" in reason
    q, _ = _quantized("relu")
    with pytest.raises(TargetUnavailableError, match=r"(?s)target 'cuda'.*why: .*next: "):
        compile_cuda(q)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert unavailable_reason() is None


def test_cli_run_target_cuda__no_gpu_message_without_traceback(tmp_path, monkeypatch):
    import yaml
    from test_cli import RECIPES, runner

    from qcompile.cli import app

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    data = yaml.safe_load((RECIPES / "digits_cnn.yaml").read_text())
    data["calibration"]["batches"] = 1
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["run", str(path), "-t", "cuda", "-o", str(tmp_path / "o")])
    assert "Traceback" not in result.output
    cuda = json.loads((tmp_path / "o" / "report.json").read_text())["targets"]["cuda"]
    if unavailable_reason() is None:
        assert cuda["status"] == "ok" and cuda["kernels"]["host_ops"] == []
    else:
        assert result.exit_code == 1, result.output       # no requested target ran
        assert "no requested target ran" in result.output
        assert cuda["status"] == "unavailable" and "TRITON_INTERPRET=1" in cuda["reason"]
        assert "cuda       unavailable: " in result.output

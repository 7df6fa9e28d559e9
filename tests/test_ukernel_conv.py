"""The VNNI conv microkernel (qcompile/codegen/ukernel): standalone, bit-exact with the reference
interpreter through IREE on small odd shapes; wired into target cpu (emit_ukernel), bit-exact on
the chain table at batch 1 and 4 with the report naming the convs it lowered, the stock lowering
still exact with it forced off, saved artifacts that run, and the fallbacks when it cannot be
used. Skipped without gcc or AVX-512 VNNI (except the tests of why it is not used)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cpu_target import _assert_bit_exact, _quantized
from test_reference import KINDS

from qcompile.codegen import emit_ukernel, iree_cpu, ukernel
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.frontend.quantize import QuantizeConfig
from qcompile.reference import interpreter
from qcompile.runtime import artifact

needs_vnni = pytest.mark.skipif(shutil.which("gcc") is None or not ukernel.host_has_vnni(),
                                reason="needs gcc and an AVX-512 VNNI host")
QCOMPILE = QuantizeConfig(quantizer="qcompile")
GROUPED = {"depthwise", "grouped"}
# the chain table's depthwise conv has 8 channels: not one qk_dwconv_u8s8 takes
DEPTHWISE_8 = ("depthwise conv of 8 channels (not a multiple of 16)" if ukernel.host_has_vbmi()
               else "depthwise conv: the host CPU has no AVX-512 VBMI (vpermt2b)")

_spec = importlib.util.spec_from_file_location(
    "ukernel_conv_bench", Path(__file__).resolve().parent.parent / "scripts" /
    "ukernel_conv_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
_kspec = importlib.util.spec_from_file_location(
    "ukernel_kernel_bench", Path(__file__).resolve().parent.parent / "scripts" /
    "ukernel_kernel_bench.py")
kbench = importlib.util.module_from_spec(_kspec)
_kspec.loader.exec_module(kbench)


@needs_vnni
@pytest.mark.parametrize("name", list(bench.CHECKS))   # tiles spanning output rows too
def test_microkernel_conv__bit_exact_with_reference(name):
    h, w, c, f, k, s, p, residual = bench.CHECKS[name]
    rng = np.random.default_rng(0)
    g, wv, bias, rq, (oh, ow) = bench.qir_chain(h, w, c, f, k, s, p, residual, rng)
    inputs = [rng.integers(0, 256, (1, h, w, c), dtype=np.uint8)]
    if residual:
        inputs.append(rng.integers(0, 256, (1, oh, ow, f), dtype=np.uint8))
    text = bench.ukernel_mlir(h, w, c, f, k, s, p, residual, wv, bias, rq, oh, ow, 7,
                              ukernel.build_object())
    got = iree_cpu.Module(bench.compile_mlir(text, iree_cpu.FAST_FLAGS))(
        *[a.view(np.int8) for a in inputs])[0]
    np.testing.assert_array_equal(got.view(np.uint8), interpreter.run(g, *inputs)[0])


@needs_vnni
@pytest.mark.parametrize("wide", [False, True])
def test_microkernel_epilogues__narrow_and_wide_bit_exact_on_every_output_range(tmp_path, wide):
    """The kernel called directly (no IREE) on layers cycling through s8 / u8 outputs with and
    without relu or a narrower clamp, with and without a residual, against numpy; the 32-bit
    lane epilogue where pack_params allows it, and the i64 one forced."""
    lib = kbench.build(ukernel.SOURCE, tmp_path)
    rng = np.random.default_rng(1)
    names = ["56x56x144-24-1x1+res", "9x11x6-40-3x3s2+res", "8x8x20-37-1x1-shift",
             "28x28x64-64-3x3+res-shift31", "28x28x32-192-1x1", "14x14x384-64-1x1",
             "8x8x20-40-1x1-shift62", "28x28x32-64-1x1-shift30", "8x8x20-72-1x1-shift62",
             "8x8x20-80-1x1", "8x8x20-96-1x1", "8x8x20-112-1x1+res"]
    chosen, folded = [], []
    for i, name in enumerate(names * 2):
        layer = kbench.layer(name, kbench.SHAPES[name], kbench.OUTPUTS[i % 5], rng, wide=wide)
        y, _ = kbench.run(lib, layer, 1)
        np.testing.assert_array_equal(y.reshape(layer["ref"].shape), layer["ref"], err_msg=name)
        chosen.append(int(layer["p"][ukernel.H_NARROW]))
        folded.append(bool(layer["p"][ukernel.H_ZFOLD]))
    # the narrow split k: 32 wherever every shift is >= 33; shift - 1 below that where the sums
    # T >> k fit in i32 (the residual conv at shift 31, the 1x1 at shift 30), not at shift 20
    # (a 31-bit multiplier); the output zero point folds into the rounding term except at
    # shift 62
    k = {"8x8x20-37-1x1-shift": 0, "28x28x64-64-3x3+res-shift31": 30,
         "28x28x32-64-1x1-shift30": 29}
    want = [0 if wide else k.get(n, 32) for n in names * 2]
    assert chosen == want
    assert folded == [w > 0 and not n.endswith("62")
                      for w, n in zip(want, names * 2, strict=True)]


@needs_vnni
@pytest.mark.parametrize("wide", [False, True])
def test_stem_tiles__unrolled_3x3_over_rgb_bit_exact(tmp_path, wide):
    """A 3x3 conv over the model input's 3 channels (padded to 4) of 32 and 64 channels takes
    the unrolled tiles (STEM3) in the lean form and the general ones in the wide form: both
    bit-exact, on two images whose output rows are no multiple of the 6-pixel tile."""
    lib = kbench.build(ukernel.SOURCE, tmp_path)
    rng = np.random.default_rng(3)
    for i, name in enumerate(["15x19x3-32-3x3s2", "15x19x3-64-3x3s2"] * 3):
        layer = kbench.layer(name, kbench.SHAPES[name], kbench.OUTPUTS[i % 5], rng, wide=wide)
        y, _ = kbench.run(lib, layer, 1)
        np.testing.assert_array_equal(y.reshape(layer["ref"].shape), layer["ref"], err_msg=name)


@needs_vnni
@pytest.mark.parametrize("vbmi", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ukernel.host_has_vbmi(), reason="needs AVX-512 VBMI"))])
def test_microkernel_table_epilogue__bit_exact_narrow_and_wide(tmp_path, vbmi):
    """A 256-entry table after the requantize (H_LUT: GELU after FFN in), looked up by
    vpermt2b (objects built for AVX-512 VBMI) or vpgatherdd, on s8 and u8 outputs, clamped
    narrower, with a residual, narrow and wide epilogues."""
    flags = ukernel.BASE_CFLAGS + (("-mavx512vbmi",) if vbmi else ())
    lib = kbench.build(ukernel.SOURCE, tmp_path, flags)
    rng = np.random.default_rng(2)
    names = ["56x56x144-24-1x1+res", "8x8x20-37-1x1-shift", "28x28x32-192-1x1",
             "9x11x6-40-3x3s2+res", "14x14x384-64-1x1"]
    for wide in (False, True):
        for i, name in enumerate(names):
            layer = kbench.layer(name, kbench.SHAPES[name], kbench.OUTPUTS[i % 5], rng,
                                 wide=wide, lut=True)
            assert layer["p"][ukernel.H_LUT] == 1
            y, _ = kbench.run(lib, layer, 1)
            np.testing.assert_array_equal(y.reshape(layer["ref"].shape).view(np.uint8),
                                          layer["ref"].astype(np.uint8), err_msg=name)


def test_narrow_epilogue__only_where_the_32_bit_form_is_exact():
    ok = dict(bias=np.array([5, -9]), m0=np.array([2**30, 2**31 - 1]), m1=np.zeros(2, int),
              shift=np.array([33, 62]), acc_bound=1000)
    assert ukernel.narrow_epilogue(**ok) and ukernel.narrow_shift(**ok) == 32
    # below shift 33: k = min(shift) - 1 where |T >> k| and the rounding term fit in i32 and
    # every shift - k is at most 31
    low = {**ok, "shift": np.array([31, 40]), "m0": np.array([2**20, 2**20])}
    assert not ukernel.narrow_epilogue(**low) and ukernel.narrow_shift(**low) == 30
    assert ukernel.narrow_shift(**{**low, "shift": np.array([31, 62])}) == 0       # 62 - 30
    assert ukernel.narrow_shift(**{**low, "m0": np.array([2**31 - 1, 2**30]),
                                   "acc_bound": 2**30}) == 0                     # T >> 30
    assert ukernel.narrow_shift(**{**low, "shift": np.array([1, 9])}) == 0
    assert not ukernel.narrow_epilogue(**{**ok, "shift": np.array([32, 40])})
    assert not ukernel.narrow_epilogue(**{**ok, "bias": np.array([2**31 - 1000, 0])})
    assert not ukernel.narrow_epilogue(**{**ok, "m1": np.array([2**31, 0])})
    assert not ukernel.narrow_epilogue(**{**ok, "acc_bound": 2**31})


def _compile(kind: str, ukernel_convs: bool | None, config: QuantizeConfig = QCOMPILE):
    q, x = _quantized(kind, config)
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False,
                                          ukernel_convs=ukernel_convs))
    return model, x


@needs_vnni
@pytest.mark.parametrize("kind", KINDS)
def test_chain__ukernel_cpu_equals_reference_bit_for_bit(kind):
    model, x = _compile(kind, True)
    _assert_bit_exact(model, x)                        # batch 1 and 4
    rep = model.report["compile"]["ukernel"]
    # Chain: stem (3 -> 8, 3x3), conv (8 -> 8, grouped in two kinds), mix (1x1, after the cat)
    # and the classifier (linear -> dequantize: f32 logits out of the kernel)
    want = ["stem conv2d", *([] if kind in GROUPED else ["conv conv2d_1"]),
            *(["mix conv2d_2"] if kind == "cat" else []), "fc linear"]
    assert rep["used"] and rep["chains"] == {"1": len(want), "4": len(want)}
    assert [loc.split(" ", 1)[1] for loc in rep["lowered"]] == want
    assert rep["float_epilogue"] == 1
    assert rep["stock"] == ({"conv: grouped conv": 1} if kind == "grouped" else
                            {f"conv: {DEPTHWISE_8}": 1} if kind == "depthwise" else {})
    assert model.report["compile"]["workarounds"] == {}


@pytest.mark.parametrize("kind", KINDS)
def test_chain__ukernel_off__stock_lowering_equals_reference(kind):
    model, x = _compile(kind, False)
    _assert_bit_exact(model, x)
    rep = model.report["compile"]["ukernel"]
    assert not rep["used"] and rep["chains"] == {"1": 0, "4": 0}
    assert rep["why"] == "off (compile option ukernel_convs: false)"


@needs_vnni
@pytest.mark.parametrize("config", [
    QuantizeConfig(quantizer="qcompile", activations="per_tensor_symmetric"),  # s8 activations
    QuantizeConfig(quantizer="x86"),                  # float islands: dequant epilogues stay
], ids=["int8-activations", "x86-float-islands"])
def test_chain_variants__ukernel_where_supported(config):
    model, x = _compile("add_relu", True, config)
    rep = model.report["compile"]["ukernel"]
    graph = model.runner.modules[4].graph
    got = model.runner.modules[4].module()(x.numpy())
    want = interpreter.run(graph, x.numpy())
    if config.quantizer == "qcompile":
        np.testing.assert_array_equal(got[0], want[0])
        assert rep["chains"] == {"1": 3, "4": 3}          # two convs and the f32 classifier
    else:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert any("not a requantize" in why for why in rep["stock"])


@needs_vnni
def test_ukernel_chains__one_dispatch_each_writing_int8():
    from qcompile.codegen import cpu
    from qcompile.codegen.target import analyze_kernels
    from qcompile.reference.program import lower

    q, _ = _quantized("add_relu", QCOMPILE)
    runner, _ = cpu.build({4: lower(q, 4).graph}, ukernel_convs=True)
    k = analyze_kernels(runner)
    assert k["by_kind"]["conv"] == 2 and k["max_per_chain"] == 1 and k["i32_writes"] == 0
    assert "hal.executable private @qk_conv_" in runner.modules[4].mlir


@needs_vnni
def test_ukernel_artifact__saved_and_reloaded_runs_bit_exactly(tmp_path):
    model, x = _compile("add", True)
    path = artifact.save(model, tmp_path / "m.qca")
    loaded = artifact.load(path)
    for b in (1, 4):
        np.testing.assert_array_equal(loaded(x[:b]).numpy(), model(x[:b]).numpy())
    np.testing.assert_array_equal(
        loaded(x[:1]).numpy(),
        interpreter.run(model.runner.modules[1].graph, x[:1].numpy())[0])


@needs_vnni
def test_ukernel_compile_failure__falls_back_to_stock_convs(monkeypatch):
    real = emit_ukernel.link
    monkeypatch.setattr(emit_ukernel, "link", lambda text, calls, obj, target, pooled: real(
        text, calls, Path("/nonexistent/conv_vnni.o"), target, pooled))
    model, x = _compile("relu", True)
    assert model.report["compile"]["workarounds"] == {"1": "stock-convs", "4": "stock-convs"}
    rep = model.report["compile"]["ukernel"]
    assert not rep["used"] and "failed to compile" in rep["why"]
    _assert_bit_exact(model, x)


def test_ukernel_support__says_why_not(monkeypatch):
    assert emit_ukernel.support(False).obj is None
    monkeypatch.setattr(ukernel, "host_has_vnni", lambda: False)
    got = emit_ukernel.support(None)
    assert got.obj is None and "no AVX-512 VNNI" in got.why
    monkeypatch.setattr(ukernel, "host_has_vnni", lambda: True)
    monkeypatch.setenv("QCOMPILE_CC", "no-such-gcc")
    got = emit_ukernel.support(True)
    assert got.obj is None and "gcc not found" in got.why


def test_ukernel_unavailable__stock_lowering_and_the_reason_in_the_report(monkeypatch):
    monkeypatch.setattr(ukernel, "host_has_vnni", lambda: False)
    q, x = _quantized("relu", QCOMPILE)
    model = compile_cpu(q, CompileOptions(batch_sizes=(1,), analyze=False))
    rep = model.report["compile"]["ukernel"]
    assert rep == {"used": False, "why": rep["why"], "chains": {"1": 0},
                   "lowered": [], "stock": {}, "narrow_epilogue": 0, "input_quantize": 0,
                   "shared_input_dispatches": 0, "float_epilogue": 0, "float_residual_adds": 0,
                   "attention": 0, "table_epilogue": 0, "depthwise": 0, "winograd": 0}
    assert "no AVX-512 VNNI" in rep["why"]
    np.testing.assert_array_equal(model(x[:1]).numpy(), interpreter.run(
        model.runner.modules[1].graph, x[:1].numpy())[0])


@needs_vnni
@pytest.mark.parametrize("rows,k,n,x_dt,residual", [
    ((1, 128), 64, 96, "u8", False),       # M 128: one kernel row of 128 pixels
    ((2, 7), 30, 40, "i8", True),          # K padded to 32 by the zero point; s8 in, residual
    ((1,), 48, 20, "u8", False),           # the batch-1 classifier row
    ((3, 97), 16, 33, "u8", True),         # M 291 = 3 x 97: rows of 97
])
def test_linear_chain__microkernel_equals_reference_bit_for_bit(rows, k, n, x_dt, residual):
    from qcompile.codegen import cpu
    from qcompile.ir import qmath
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    rng = np.random.default_rng(5)
    xd = DType(x_dt)
    x = node(Op.INPUT, xd, (*rows, k), name="x")
    w = node(Op.CONST, DType.I8, (n, k), value=rng.integers(-128, 128, (n, k), np.int8))
    bias = node(Op.CONST, DType.I32, (n,), value=rng.integers(-900, 900, n, np.int32))
    lin = node(Op.QLINEAR, DType.I32, (*rows, n), x, w, bias, x_zp=-3 if x_dt == "i8" else 131)
    out = QParams(DType.U8, (1.0,), (7,), 0, 255)
    srcs, reals, zps = [lin], [np.linspace(2e-4, 6e-4, n)], [0]
    ins = [x]
    if residual:
        r = node(Op.INPUT, DType.I8, lin.shape, name="r")
        srcs.append(r)
        reals.append([0.3])
        zps.append(-5)
        ins.append(r)
    rq = node(Op.REQUANT, DType.U8, lin.shape, *srcs,
              rq=qmath.make_requant(reals, zps, out, axis=len(lin.shape) - 1))
    graph = Graph("linear_chain", tuple(ins), (rq,))
    module = cpu.compile_graph(graph, 1, uk=emit_ukernel.support(True))
    assert module.workaround is None and module.ukernel["chains"] == 1
    inputs = [rng.integers(*i.dtype.range, endpoint=True, size=i.shape).astype(i.dtype.np)
              for i in ins]
    got = module.module()(*inputs)[0]
    np.testing.assert_array_equal(got.view(np.uint8), interpreter.run(graph, *inputs)[0])


@needs_vnni
@pytest.mark.parametrize("x_dt,k,ns", [
    ("u8", 64, (96, 96, 96)),          # attention's q, k, v: one dispatch
    ("i8", 30, (40, 72, 17)),          # K padded to 32, widths that are no multiple of 64
])
def test_linears_sharing_their_input__one_dispatch_bit_exact(x_dt, k, ns):
    """Linears reading the same tensor run as one qk_linear_multi dispatch (each with its own
    weights and requantize, s8 and u8 outputs alike); a linear with a residual keeps its own."""
    from qcompile.codegen import cpu
    from qcompile.ir import qmath
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    rng = np.random.default_rng(9)
    xd = DType(x_dt)
    x = node(Op.INPUT, xd, (2, 13, k), name="x")
    r = node(Op.INPUT, DType.I8, (2, 13, 24), name="r")
    outs = []
    for i, n in enumerate((*ns, 24)):
        w = node(Op.CONST, DType.I8, (n, k), value=rng.integers(-128, 128, (n, k), np.int8))
        bias = node(Op.CONST, DType.I32, (n,), value=rng.integers(-900, 900, n, np.int32))
        lin = node(Op.QLINEAR, DType.I32, (2, 13, n), x, w, bias,
                   x_zp=-3 if x_dt == "i8" else 131)
        qp = QParams(DType.I8, (1.0,), (i - 2,), -128, 127)
        reals, zps, srcs = [np.linspace(2e-4, 6e-4 * (i + 1), n)], [0], [lin]
        if n == 24:                                         # the residual linear
            reals, zps, srcs = [*reals, [0.3]], [0, -5], [lin, r]
        outs.append(node(Op.REQUANT, DType.I8, lin.shape, *srcs,
                         rq=qmath.make_requant(reals, zps, qp, axis=2)))
    graph = Graph("shared_input", (x, r), tuple(outs))
    module = cpu.compile_graph(graph, 1, uk=emit_ukernel.support(True))
    assert module.ukernel["chains"] == 4 and module.ukernel["shared_input_dispatches"] == 1
    inputs = [rng.integers(*i.dtype.range, endpoint=True, size=i.shape).astype(i.dtype.np)
              for i in (x, r)]
    for got, want in zip(module.module()(*inputs), interpreter.run(graph, *inputs), strict=True):
        np.testing.assert_array_equal(got.view(want.dtype), want)


@needs_vnni
@pytest.mark.parametrize("rows,k,n,x_dt,per_channel,residual", [
    ((2, 16), 64, 40, "u8", True, "add"),    # MiniLM's out projection / FFN down: + f32 stream
    ((1, 7), 30, 33, "i8", False, None),     # K padded to 32, per-tensor, f32 out alone
    ((3, 5), 16, 24, "u8", True, "bcast"),   # a broadcast add stays a separate op
])
def test_linear_dequant__microkernel_f32_out_and_fused_add_bit_exact(rows, k, n, x_dt,
                                                                      per_channel, residual):
    """``linear → dequantize (→ + f32 residual)``: the kernel writes f32 (``float32((acc +
    bias) · m) · 2^-sh``) and adds a same-shaped f32 residual in its epilogue."""
    from qcompile.codegen import cpu
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    rng = np.random.default_rng(11)
    x = node(Op.INPUT, DType(x_dt), (*rows, k), name="x")
    w = node(Op.CONST, DType.I8, (n, k), value=rng.integers(-128, 128, (n, k), np.int8))
    bias = node(Op.CONST, DType.I32, (n,), value=rng.integers(-900, 900, n, np.int32))
    lin = node(Op.QLINEAR, DType.I32, (*rows, n), x, w, bias, x_zp=-3 if x_dt == "i8" else 131)
    scale = tuple(np.linspace(1e-4, 7e-3, n).astype(np.float32)) if per_channel else (3e-3,)
    zps = tuple(rng.integers(-50, 50, len(scale)).tolist())
    qp = QParams(DType.I32, scale, zps, *DType.I32.range, axis=2 if per_channel else None)
    out = node(Op.DEQUANT, DType.F32, lin.shape, lin, qp=qp)
    ins = [x]
    if residual:
        shape = lin.shape if residual == "add" else (n,)
        r = node(Op.INPUT, DType.F32, shape, name="r")
        out = node(Op.ADD, DType.F32, lin.shape, r, out)
        ins.append(r)
    graph = Graph("linear_dequant", tuple(ins), (out,))
    module = cpu.compile_graph(graph, 1, uk=emit_ukernel.support(True))
    assert module.ukernel["chains"] == 1 and module.ukernel["float_epilogue"] == 1
    assert module.ukernel["float_residual_adds"] == (residual == "add")
    inputs = [rng.integers(*x.dtype.range, endpoint=True, size=x.shape).astype(x.dtype.np)]
    if residual:
        inputs.append((rng.standard_normal(ins[1].shape) * 3).astype(np.float32))
    got = module.module()(*inputs)[0]
    np.testing.assert_array_equal(got, interpreter.run(graph, *inputs)[0])


class _ResBlocks(torch.nn.Module):
    """A stem read by a max pool, a block output read by a padded conv and a 1x1 stride-2 conv
    without padding, and one read by a padded conv and as the next block's residual: the
    buffers resnets share between their readers."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv2d
        self.stem, self.pool = conv(3, 16, 3, padding=1), torch.nn.MaxPool2d(3, 2, 1)
        self.a1, self.a2 = conv(16, 16, 3, padding=1), conv(16, 16, 3, padding=1)
        self.b1, self.b2 = conv(16, 32, 3, 2, 1), conv(32, 32, 3, padding=1)
        self.down = conv(16, 32, 1, 2)
        self.c1, self.c2 = conv(32, 32, 3, padding=1), conv(32, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        relu = torch.relu
        x = self.pool(relu(self.stem(x)))
        y = relu(self.a2(relu(self.a1(x))) + x)
        z = relu(self.b2(relu(self.b1(y))) + self.down(y))
        w = relu(self.c2(relu(self.c1(z))) + z)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(w, 1), 1))


def _emitted_convs(module: torch.nn.Module, h: int, w: int):
    """``module`` quantized on random 3 x h x w images, emitted at batch 4 with the microkernel:
    (the quantized model, the batches, the emitter, each conv's ConvShape by its loc)."""
    from qcompile.codegen.mlir_emit import EmitOptions, emit
    from qcompile.frontend.quantize import quantize
    from qcompile.reference.program import lower

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, h, w, generator=gen),) for _ in range(3)]
    q = quantize(module.eval(), batches[0], batches, QCOMPILE)
    _, em = emit(lower(q, 4).graph, EmitOptions(ukernel_convs=True))
    convs = {c.loc.split(" ", 1)[1]: c.shape for c in em.uk_calls if c.loc and c.quantize is None
             and "conv" in c.loc}
    return q, batches, em, convs


@needs_vnni
def test_shared_outputs__written_bordered_once_and_read_in_place_bit_exact():
    q, batches, em, convs = _emitted_convs(_ResBlocks(), 16, 16)
    stem, a2, b2, down, c2 = (convs[k] for k in ("stem conv2d", "a2 conv2d_2", "b2 conv2d_4",
                                                 "down conv2d_5", "c2 conv2d_7"))
    assert (stem.out_pad, stem.out_fill) == ((1, 1), 0)      # the max pool's border (u8 min)
    assert a2.out_pad == (1, 1)                               # read by b1 and by down
    assert down.x_off == (1 * 10 + 1) * 16 and (down.hp, down.wp) == (10, 10)
    assert b2.out_pad == (1, 1) and c2.res_pad == (1, 1)      # z: by c1 and as c2's residual
    # the max pool reads the stem's buffer; only its own output (read by a1 and as a2's
    # residual, no microkernel output) is still copied into a padded buffer
    assert em.module.operation.get_asm().count("tensor.insert_slice") == 1
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False,
                                          ukernel_convs=True))
    _assert_bit_exact(model, batches[1][0])
    assert model.report["compile"]["ukernel"]["chains"] == {"1": 9, "4": 9}


class _PairBlocks(torch.nn.Module):
    """24- and 8-channel convs (pixel pairs) on odd widths: a stem whose output is bordered for
    the padded convs reading it and read from that border as a residual, and a last pixel alone
    at each image's end."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv2d
        self.stem, self.a1 = conv(3, 24, 3, padding=1), conv(24, 24, 3, padding=1)
        self.a2, self.p = conv(24, 24, 3, padding=1), conv(24, 8, 1)
        self.b = conv(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        relu = torch.relu
        x = relu(self.stem(x))
        y = relu(self.a2(relu(self.a1(x))) + x)
        z = self.b(relu(self.p(y)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(z, 1), 1))


@needs_vnni
def test_pixel_pairs__24_and_8_channel_convs_bit_exact_across_borders_and_row_ends(
        monkeypatch):
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 1)     # where pairs pay
    q, batches, _, convs = _emitted_convs(_PairBlocks(), 7, 11)
    stem, a2, p, b = (convs[k] for k in ("stem conv2d", "a2 conv2d_2", "p conv2d_3",
                                         "b conv2d_4"))
    assert stem.pair and a2.pair and p.pair and b.pair and (stem.fp, b.fp) == (48, 16)
    assert stem.out_pad == (1, 1) and a2.res_pad == (1, 1)   # pairs through the buffer
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False,
                                          ukernel_convs=True))
    _assert_bit_exact(model, batches[1][0])
    assert model.report["compile"]["ukernel"]["chains"] == {"1": 6, "4": 6}   # and the fc


def test_pixel_pairs__only_where_vpdpbusd_issues_once_a_cycle(monkeypatch):
    """F = 8 and 24 run as pairs on a one-pipe host (Zen 4), as single pixels on a two-pipe one
    (Zen 5), never for a depthwise conv; the kernel's own condition ignores the host."""
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 1)
    assert ukernel.pairs_fit(24) and ukernel.pairs_fit(8) and not ukernel.pairs_fit(16)
    assert not ukernel.pairs_fit(24, depthwise=True)
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 2)
    assert not ukernel.pairs_fit(24) and not ukernel.pairs_fit(8)
    assert ukernel.pairs_fit(24, speed=False) and not ukernel.pairs_fit(40, speed=False)


@needs_vnni
def test_port_bench__every_mix_timed_at_a_plausible_rate():
    spec = importlib.util.spec_from_file_location(
        "vnni_port_bench", Path(__file__).resolve().parent.parent / "scripts" /
        "vnni_port_bench.py")
    ports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ports)
    (row,) = ports.run(20_000, [0])
    assert 0.5 < row["clock"] < 8                      # GHz
    for name, _ in ports.MIXES:                        # instructions per cycle, 0.1 .. 6
        assert 0.1 < row[name] / row["clock"] < 6, name
    text = ports.table([row])
    assert text.count("\n| ") == len(ports.MIXES) + 1 and "vpdpbusd GOPS per core" in text


class _Stem(torch.nn.Module):
    def __init__(self, c: int, k: int, s: int) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(c, 24, k, s, k // 2)
        self.head = torch.nn.Conv2d(24, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.stem(x)))


@needs_vnni
@pytest.mark.parametrize("c,k,s,packed", [
    (3, 7, 2, True),       # resnet's stem: 6 quads per kernel row instead of 7
    (3, 5, 1, True),       # 4 quads instead of 5
    (2, 5, 2, True),
    (3, 3, 2, False),      # 9 bytes take 3 quads either way
])
def test_stem_over_the_model_input__packed_rows_bit_exact(c, k, s, packed):
    """A stem fed by the microkernel quantize reads the input packed (C bytes a pixel, each
    kernel row as one column of KW * C bytes) where that takes fewer quads: bit-exact with the
    reference at batch 1 and 3, on widths that are no multiple of 16 (the quantize's masked
    tail, the last window's read past the row)."""
    from qcompile.codegen.mlir_emit import EmitOptions, emit
    from qcompile.frontend.quantize import quantize
    from qcompile.reference.program import lower

    packed = packed and ukernel.host_has_vbmi()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(3, c, 23, 37, generator=gen),) for _ in range(3)]
    q = quantize(_Stem(c, k, s).eval(), batches[0], batches, QCOMPILE)
    _, em = emit(lower(q, 3).graph, EmitOptions(ukernel_convs=True))
    quant = next(u for u in em.uk_calls if u.quantize is not None)
    stem = next(u.shape for u in em.uk_calls if u.loc and "stem" in u.loc and u.quantize is None)
    assert quant.quantize.packed is packed
    if packed:
        assert (stem.xstep, stem.kw, stem.c) == (c, 1, -(-k * c // 4) * 4)
        pixels = 3 * (23 + k // 2 * 2) * (37 + k // 2 * 2)
        assert quant.quantize.out_size == stem.in_size == pixels * c + ukernel.PACKED_SLACK
    else:
        assert (stem.xstep, stem.kw, stem.c) == (0, k, 4)
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 3), analyze=False,
                                          ukernel_convs=True))
    _assert_bit_exact(model, batches[1][0])
    assert model.report["compile"]["ukernel"]["input_quantize"]


WINO_SHAPES = ["10x13x32-64-3x3+res", "56x56x64-64-3x3", "28x28x128-128-3x3",
               "14x14x256-256-3x3", "7x7x256-128-3x3", "56x56x64-64-3x3+res-near1",
               "28x28x64-64-3x3+res-shift31"]


@needs_vnni
@pytest.mark.parametrize("wide", [False, True])
def test_winograd_kernel__bit_exact_with_the_direct_sums_on_every_output_range(tmp_path, wide):
    """qk_wino_u8s8 called directly on 3x3 stride-1 layers (OH and OW no multiple of 4, two
    images, residuals, tiles of a chunk spanning bands) cycling through the output ranges,
    against numpy's direct sums: bit for bit in the 32-bit lane epilogue and the i64 one."""
    lib = kbench.build(ukernel.SOURCE, tmp_path)
    rng = np.random.default_rng(2)
    for i, name in enumerate(WINO_SHAPES * 2):
        layer = kbench.layer(name, kbench.SHAPES[name], kbench.OUTPUTS[i % 5], rng, wide=wide,
                             wino=True)
        assert layer["shp"].wino
        y, _ = kbench.run(lib, layer, 1)
        np.testing.assert_array_equal(y.reshape(layer["ref"].shape), layer["ref"], err_msg=name)


def test_winograd_fits__only_where_the_recovery_is_exact(monkeypatch):
    """The Winograd entry takes 3x3 stride-1 convs with C a multiple of 32 up to 256 (on a
    host issuing one 512-bit vpdpbusd a cycle) and F a multiple of 64, enough output pixels per
    transformed weight byte, and exact sums below 2^25 (128 · Σ|w| per output channel); the
    reason otherwise."""
    from dataclasses import replace

    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 1)
    s = ukernel.ConvShape(1, 16, 16, 64, 64, 3, 3, 1, 1, 1, 1, 14, 14)
    w = np.full((64, 3, 3, 64), 127, np.int8)
    assert ukernel.wino_fits(s, w) is None                    # 128 · 576 · 127 < 2^25
    # 128 · 2304 · 127 >= 2^25 (a worst case real weights do not reach): the direct kernel
    s256 = replace(s, c=256, n=8)
    assert "too large" in ukernel.wino_fits(s256, np.full((64, 3, 3, 256), 127, np.int8))
    edge = np.zeros((64, 3, 3, 256), np.int8)
    edge[5].flat[:2064] = -127                                 # 128 · 262128 < 2^25
    edge[5].flat[2064] = 15
    assert ukernel.wino_fits(s256, edge) is None
    edge[5].flat[2064] = 16                                    # 128 · Σ|w| == 2^25
    assert "too large" in ukernel.wino_fits(s256, edge)
    assert "stride-1" in ukernel.wino_fits(replace(s, sh=2, sw=2), w)
    assert "stride-1" in ukernel.wino_fits(replace(s, kh=1, kw=1), w[:, :1, :1])
    assert "multiple" in ukernel.wino_fits(replace(s, f=48), w[:48])
    assert "multiple" in ukernel.wino_fits(replace(s, c=20), w[..., :20])
    assert "above 256" in ukernel.wino_fits(replace(s, c=512), np.zeros((64, 3, 3, 512),
                                                                         np.int8))
    assert "plain" in ukernel.wino_fits(replace(s, x_off=64), w)
    # 36 · 256 · 256 · 2 bytes of transformed weights over 14 x 14 pixels: 24 KB per pixel at
    # batch 1 and 12 KB at batch 2 (the weights' traffic costs more than the sums save), 6 KB
    # at batch 4
    deep = ukernel.ConvShape(1, 16, 16, 256, 256, 3, 3, 1, 1, 1, 1, 14, 14)
    w256 = np.ones((256, 3, 3, 256), np.int8)
    assert "too few output pixels" in ukernel.wino_fits(deep, w256)
    assert "too few output pixels" in ukernel.wino_fits(replace(deep, n=2), w256)
    assert ukernel.wino_fits(replace(deep, n=4), w256) is None
    assert ukernel.wino_fits(deep, w256, speed=False) is None     # the kernel takes both
    assert ukernel.wino_fits(replace(s, c=512), np.zeros((64, 3, 3, 512), np.int8),
                             speed=False) is None


def test_winograd_fits__direct_where_vpdpbusd_issues_twice(monkeypatch):
    """Where vpdpbusd issues twice a cycle (Zen 5) every conv stays direct (Winograd's 8x
    weight bytes cost more in a model than its sums save); the kernel itself still takes them,
    and a one-pipe host keeps Winograd up to C = 256."""
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 2)
    deep = ukernel.ConvShape(8, 16, 16, 256, 256, 3, 3, 1, 1, 1, 1, 14, 14)
    w256 = np.ones((256, 3, 3, 256), np.int8)
    mid = ukernel.ConvShape(1, 30, 30, 128, 128, 3, 3, 1, 1, 1, 1, 28, 28)
    w128 = np.ones((128, 3, 3, 128), np.int8)
    for shape, w in ((deep, w256), (mid, w128)):
        assert "vpdpbusd issues twice a cycle" in ukernel.wino_fits(shape, w)
        assert ukernel.wino_fits(shape, w, speed=False) is None     # the kernel takes it
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 1)
    assert ukernel.wino_fits(deep, w256) is None
    assert ukernel.wino_fits(mid, w128) is None


def test_vnni_pipes__from_cpuinfo():
    """Two 512-bit vpdpbusd a cycle on AMD family 1Ah (Zen 5) and later; one on Zen 4, Intel
    and anything unreadable. Only the first processor's lines count."""
    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
    assert ukernel.vnni_pipes(zen5) == 2
    assert ukernel.vnni_pipes(zen5 + "\nprocessor\t: 1\ncpu family\t: 25\n") == 2
    assert ukernel.vnni_pipes(zen5.replace("26", "25")) == 1
    assert ukernel.vnni_pipes(zen5.replace("AuthenticAMD", "GenuineIntel").replace("26", "6")) == 1
    assert ukernel.vnni_pipes("vendor_id\t: AuthenticAMD\ncpu family\t: x\n") == 1
    assert ukernel.vnni_pipes("") == 1


class _WinoBlocks(torch.nn.Module):
    """3x3 stride-1 convs of 32, 64 and 128 channels on odd sizes (OH, OW no multiple of 4):
    one reading the max pool's padded output, one writing its output bordered for the next and
    read in place as a residual, one of two channel blocks, one with the residual read from a
    border; a stride-2 conv and the stem stay direct."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv2d
        self.stem, self.pool = conv(3, 32, 3, padding=1), torch.nn.MaxPool2d(3, 2, 1)
        self.a1, self.a2 = conv(32, 64, 3, padding=1), conv(64, 64, 3, padding=1)
        self.b1 = conv(64, 64, 3, 2, 1)
        self.c1, self.c2 = conv(64, 128, 3, padding=1), conv(128, 64, 3, padding=1)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        relu = torch.relu
        x = self.pool(relu(self.stem(x)))
        y = relu(self.a1(x))
        y = relu(self.a2(y) + y)
        z = relu(self.b1(y))
        w = relu(self.c2(relu(self.c1(z))) + z)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(w, 1), 1))


@needs_vnni
def test_winograd_convs__bit_exact_in_a_model_and_counted_and_off_on_request(monkeypatch):
    monkeypatch.setattr(ukernel, "host_vnni_pipes", lambda: 1)     # where Winograd pays
    q, batches, em, convs = _emitted_convs(_WinoBlocks(), 27, 34)
    wino = sorted(k for k, s in convs.items() if s.wino)
    assert wino == ["a1 conv2d_1", "a2 conv2d_2", "c1 conv2d_4", "c2 conv2d_5"]
    a2, c2 = convs["a2 conv2d_2"], convs["c2 conv2d_5"]
    assert (a2.oh, a2.ow) == (14, 17) and a2.out_pad == (1, 1) and c2.res_pad == (1, 1)
    # 4 bands of 5 tiles per image, the 4 images' tiles in chunks of 12: chunks and groups of
    # 6 that start and end mid-band, and span two images
    assert (a2.n, a2.chunks, a2.chunk, a2.grid) == (4, 7, 12, (1, 7, 1))
    assert convs["c1 conv2d_4"].blocks == 2
    # pooled (batch 1 on qcompile's pool) and on IREE's task workers, whose 128 KB stacks hold
    # the kernel's ~94 KB of buffers (QCOMPILE_POOL=0); the direct kernel with winograd off;
    # batch 8 as two shards of 4, each running its grid on one thread (channel blocks slowest)
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    x8 = torch.cat([batches[1][0], batches[2][0]])
    for on, pool in ((True, "1"), (True, "0"), (False, "1")):
        monkeypatch.setenv("QCOMPILE_POOL", pool)
        model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4, 8), analyze=False,
                                              ukernel_convs=True, winograd=on))
        assert model.report["compile"]["pooled_batches"] == ([1, 4, 8] if pool == "1" else [])
        _assert_bit_exact(model, x8)
        got = model(x8).numpy()
        assert len(model.runner.modules[4]._inline) == 2          # the two shards ran
        np.testing.assert_array_equal(
            got, interpreter.run(model.runner.modules[8].graph, x8.numpy())[0])
        rep = model.report["compile"]["ukernel"]
        assert rep["chains"] == {"1": 7, "4": 7, "8": 7} and rep["winograd"] == (4 if on else 0)

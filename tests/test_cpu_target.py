"""Target cpu (QIR → MLIR → IREE): bit-exact with the reference interpreter on the chain table,
one dispatch per fused chain, MLIR that verifies, and compile failures that leave a reproducer."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch
from concurrency import run_in_threads
from test_reference import KINDS, Chain

from qcompile.codegen import cpu, iree_cpu
from qcompile.codegen.mlir_emit import emit_module
from qcompile.codegen.target import CompileOptions, analyze_kernels, compile_cpu
from qcompile.errors import CompileError, InputError
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.reference import interpreter
from qcompile.reference.program import lower


def _quantized(kind: str, config: QuantizeConfig | None = None):
    torch.manual_seed(0)
    model = Chain(kind).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(3)]
    return quantize(model, batches[0], batches, config), batches[1][0]


def _assert_bit_exact(model, x: torch.Tensor) -> None:
    for b, module in model.runner.modules.items():
        xb = x[:b].numpy()
        got = module.module()(xb)
        want = interpreter.run(module.graph, xb)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.view(w.dtype), w)


# one module per batch size: 1 and 4 compiled, 3 runs as pieces of 1
@pytest.mark.parametrize("kind", KINDS)
def test_chain__cpu_equals_reference_bit_for_bit(kind):
    q, x = _quantized(kind, QuantizeConfig(quantizer="qcompile"))
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False))
    _assert_bit_exact(model, x)
    ref = lower(q, 1).graph
    got = model(x[:3])
    want = np.concatenate([interpreter.run(ref, x[i:i + 1].numpy())[0] for i in range(3)])
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("config", [
    QuantizeConfig(quantizer="x86"),                                      # float islands
    QuantizeConfig(quantizer="qcompile", activations="per_tensor_symmetric"),  # i8 activations
    QuantizeConfig(quantizer="qcompile", weights="per_tensor_symmetric"),
], ids=["x86-float-islands", "int8-activations", "per-tensor-weights"])
def test_chain_variants__cpu_int8_tensors_match_reference(config):
    q, x = _quantized("add_relu", config)
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 4), analyze=False))
    graph = model.runner.modules[4].graph
    got = model.runner.modules[4].module()(x.numpy())
    want = interpreter.run(graph, x.numpy())
    # integer chains are exact; float islands (x86 leaves pools/adds in float) may differ in
    # the last bits of their sums
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    if config.quantizer == "qcompile":
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("kind", ["add_relu", "strided", "depthwise", "cat"])
def test_chain__each_contraction_chain_is_one_dispatch_writing_int8(kind):
    q, _ = _quantized(kind, QuantizeConfig(quantizer="qcompile"))
    runner, _ = cpu.build({4: lower(q, 4).graph})
    k = analyze_kernels(runner)
    assert k["chains"] >= 3
    assert k["max_per_chain"] == 1
    assert k["i32_writes"] == 0
    assert all(row["writes"] in (["i8"], ["f32"]) for row in k["per_chain"])


def test_residual_block_with_projection__no_accumulator_leaves_its_dispatch():
    from test_recipes_cpu import projection_block_model

    q, x = projection_block_model()
    runner, _ = cpu.build({2: lower(q, 2).graph})
    k = analyze_kernels(runner)
    assert k["i32_writes"] == 0 and k["max_per_chain"] == 1


def test_emitted_mlir_verifies_and_uses_the_u8_s8_form():
    q, _ = _quantized("relu", QuantizeConfig(quantizer="qcompile"))
    text = str(emit_module(lower(q, 4).graph))
    assert "func.func @main(%arg0: tensor<4x3x12x12xf32>) -> tensor<4x6xf32>" in text
    assert "arith.extui" in text and "arith.extsi" in text          # u8 x s8 contraction
    assert "arith.shrsi" in text and "i64" in text                  # fixed-point requantize
    assert "math.roundeven" in text                                 # PT2E's quantize
    assert "linalg.conv" not in text                                # implicit GEMM, no named conv


def test_compile_failure__saves_mlir_and_prints_the_command(tmp_path, monkeypatch):
    q, _ = _quantized("relu")
    monkeypatch.setattr(iree_cpu, "FAST_FLAGS", ("--iree-no-such-flag",))
    monkeypatch.setattr(iree_cpu, "WORKAROUNDS", ())
    with pytest.raises(CompileError, match="reproduce with: .*iree-compile") as err:
        compile_cpu(q, CompileOptions(batch_sizes=(1,), keep_dir=str(tmp_path)))
    saved = list(tmp_path.glob("*.failed.mlir"))
    assert len(saved) == 1 and "func.func @main" in saved[0].read_text()
    assert str(saved[0]) in str(err.value)


def test_compile_failure__workaround_ladder_reports_what_worked(monkeypatch):
    q, x = _quantized("relu")
    monkeypatch.setattr(iree_cpu, "FAST_FLAGS", ("--iree-no-such-flag",))
    model = compile_cpu(q, CompileOptions(batch_sizes=(1,), analyze=False))
    assert model.report["compile"]["workarounds"] == {"1": "no-inner-tiled"}
    _assert_bit_exact(model, x)


def test_cpu_model__rejects_wrong_inputs_with_a_clear_error():
    q, x = _quantized("relu")
    model = compile_cpu(q, CompileOptions(batch_sizes=(1,), analyze=False))
    with pytest.raises(InputError, match="shape is"):
        model(torch.zeros(1, 3, 10, 12))
    with pytest.raises(InputError, match="dtype is torch.float64"):
        model(x[:1].double())
    with pytest.raises(InputError, match="batch is empty"):
        model(x[:0])


def test_pieces__split_largest_first():
    assert cpu.pieces(13, [1, 4, 8]) == [8, 4, 1]
    assert cpu.pieces(8, [1, 8]) == [8]
    with pytest.raises(ValueError, match="fits no compiled size"):
        cpu.pieces(3, [2])


# the batch GEMM form of QMATMUL (u8 × s8 plus rank-1 zero-point corrections), stock and on
# the VNNI microkernel (operands packed at run time): every operand dtype, zero or non-zero zero
# points, a Kᵀ operand read in place, and a broadcast batch (the direct form)
@pytest.mark.parametrize("ukernel_on", [False, True], ids=["stock", "ukernel"])
@pytest.mark.parametrize("a_dt,b_dt,a_zp,b_zp,transposed,b_batch", [
    ("u8", "u8", 131, 7, True, (1, 3)),
    ("i8", "u8", -5, 0, False, (1, 3)),
    ("u8", "i8", 0, -3, True, (1, 3)),
    ("i8", "i8", 0, 0, False, (1, 3)),
    ("u8", "i8", 200, 100, False, (1,)),
    ("u8", "i8", 50, 0, False, (1, 3)),
    ("u8", "i8", 50, 0, True, (1, 3)),
])
def test_qmatmul__cpu_equals_reference_bit_for_bit(a_dt, b_dt, a_zp, b_zp, transposed, b_batch,
                                                   ukernel_on):
    from qcompile.codegen import emit_ukernel, ukernel
    from qcompile.ir import qmath
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    rng = np.random.default_rng(3)
    da, db = DType(a_dt), DType(b_dt)
    a = node(Op.INPUT, da, (1, 3, 20, 40), name="a")
    b_shape = (*b_batch, 24, 40) if transposed else (*b_batch, 40, 24)
    bin_ = node(Op.INPUT, db, b_shape, name="b")
    rhs = node(Op.PERMUTE, db, (*b_batch, 40, 24), bin_, dims=(0, 1, 3, 2)) if transposed \
        else bin_
    mm = node(Op.QMATMUL, DType.I32, (1, 3, 20, 24), a, rhs, a_zp=a_zp, b_zp=b_zp)
    out = QParams(DType.U8, (1.0,), (128,), 0, 255)
    q = node(Op.REQUANT, DType.U8, mm.shape, mm,
             rq=qmath.make_requant([[3e-4]], [0], out, axis=None))
    graph = Graph("qmatmul", (a, bin_), (q,) if ukernel_on else (q, mm))
    inputs = [rng.integers(*da.range, endpoint=True, size=a.shape).astype(da.np),
              rng.integers(*db.range, endpoint=True, size=b_shape).astype(db.np)]
    if ukernel_on and not ukernel.host_has_vnni():
        pytest.skip("needs an AVX-512 VNNI host")
    module = cpu.compile_graph(graph, 1, uk=emit_ukernel.support(True) if ukernel_on else None)
    assert module.workaround is None
    assert module.ukernel["chains"] == (ukernel_on and b_batch != (1,))
    got = module.module()(*inputs)
    for g, w in zip(got, interpreter.run(graph, *inputs), strict=True):
        np.testing.assert_array_equal(g.view(w.dtype), w)


def _extreme_depthwise(shift_floor: int, c: int = 40):
    """qconv2d (depthwise 3×3, weights ±127, inputs 0/255, large biases) → requant with an
    int8 residual whose multiplier is 2^30."""
    from qcompile.ir import qmath
    from qcompile.ir.graph import Graph, Op, node
    from qcompile.ir.types import DType, QParams

    rng = np.random.default_rng(3)
    x = node(Op.INPUT, DType.U8, (1, 9, 9, c), name="x")
    r = node(Op.INPUT, DType.I8, (1, 9, 9, c), name="r")
    wv = np.where(rng.random((c, 3, 3, 1)) < 0.5, -127, 127).astype(np.int8)
    bias = rng.integers(-2**20, 2**20, c).astype(np.int32)
    conv = node(Op.QCONV2D, DType.I32, (1, 9, 9, c), x,
                node(Op.CONST, DType.I8, wv.shape, value=wv),
                node(Op.CONST, DType.I32, bias.shape, value=bias), stride=(1, 1),
                padding=(1, 1), dilation=(1, 1), groups=c, x_zp=128, layout="nhwc")
    # the residual's real multiplier sets every channel's shift to shift_floor
    reals = [list(rng.uniform(0.5, 1.0, c) * 2.0 ** (20 - shift_floor)),
             [2.0 ** (30 - shift_floor)] * c]
    rq = qmath.make_requant(reals, [0, -5], QParams(DType.I8, (0.05,), (-7,), -128, 127), axis=3,
                            qmin=-100)
    y = node(Op.REQUANT, DType.I8, (1, 9, 9, c), conv, r, rq=rq)
    inputs = [np.where(rng.random((1, 9, 9, c)) < 0.5, 0, 255).astype(np.uint8),
              rng.integers(-128, 128, (1, 9, 9, c), dtype=np.int8)]
    return Graph("dw", (x, r), (y,)), y, inputs


@pytest.mark.parametrize("shift_floor", [33, 40, 31])
def test_stock_requant__narrow_form_bit_exact_at_extreme_values(shift_floor):
    """The stock requantize in i32 lanes (vpmuldq products, high halves shifted on) where every
    shift is >= 33, the i64 form below that: both equal the reference with accumulators near
    their bound."""
    from qcompile.codegen.mlir_emit import Acc, narrow_requant

    g, y, inputs = _extreme_depthwise(shift_floor)
    assert min(y.attrs.rq.shift) >= 31
    assert narrow_requant(y, [Acc(None, None, 3), None]) == (shift_floor >= 33)
    text = emit_module(g).operation.get_asm()
    got = iree_cpu.Module(iree_cpu.try_compile(text, (*iree_cpu.TARGET_FLAGS,
                                                      *iree_cpu.FAST_FLAGS)))(
        inputs[0].view(np.int8), inputs[1])[0]
    np.testing.assert_array_equal(got, interpreter.run(g, *inputs)[0])


def test_module__direct_call_equals_the_runtime_invoker():
    """Host modules are called on the VM directly (Module._call_direct): the same outputs as
    the runtime's generic invoker, as arrays of their own, on both host drivers. A dtype IREE
    has no element type for is a ValueError."""
    g, _, inputs = _extreme_depthwise(40)
    text = emit_module(g).operation.get_asm()
    vmfb = iree_cpu.try_compile(text, (*iree_cpu.TARGET_FLAGS, *iree_cpu.FAST_FLAGS))
    for driver in ("local-task", "local-sync"):
        m = iree_cpu.Module(vmfb, driver)
        args = (inputs[0].view(np.int8), inputs[1])
        direct = m(*args)
        vm, m._vm = m._vm, None
        generic = m(*args)
        m._vm = vm
        assert len(direct) == len(generic) == 1
        np.testing.assert_array_equal(direct[0], generic[0])
        assert direct[0].dtype == generic[0].dtype and direct[0].flags.owndata
        with pytest.raises(ValueError, match="no IREE element type"):
            m._copy_in(np.array([object()]))


def test_shard_size__even_shards_of_at_least_four():
    assert cpu.shard_size(8, 2) == 4
    assert cpu.shard_size(16, 2) == 8
    assert cpu.shard_size(6, 2) is None          # shards of 3
    assert cpu.shard_size(9, 2) is None          # uneven
    assert cpu.shard_size(8, 1) is None          # one thread
    assert cpu.shard_size(12, 3) == 4


def _affinities(pool, n):
    """Each of ``n`` tasks held at a barrier (so that ``n`` threads run them) reports its
    thread's CPU set."""
    import threading

    gate = threading.Barrier(n)

    def task():
        gate.wait(timeout=10)
        return frozenset(os.sched_getaffinity(0))

    return [f.result(timeout=20) for f in [pool.submit(task) for _ in range(n)]]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs")
def test_shard_threads__each_pinned_to_a_cpu_of_its_own(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    allowed = os.sched_getaffinity(0)
    with ThreadPoolExecutor(2, initializer=cpu._pinner(2)) as pool:
        got = _affinities(pool, 2)
    assert all(len(a) == 1 and a <= allowed for a in got) and got[0] != got[1]
    assert os.sched_getaffinity(0) == allowed                 # the caller is left alone
    # fewer CPUs allowed than shards: nothing is pinned
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {min(allowed)})
    with ThreadPoolExecutor(2, initializer=cpu._pinner(2)) as pool:
        monkeypatch.undo()
        assert _affinities(pool, 2) == [frozenset(allowed)] * 2


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_threads_env__malformed_is_a_clear_error(monkeypatch, value):
    from qcompile.errors import ConfigError

    monkeypatch.setenv("QCOMPILE_THREADS", value)
    with pytest.raises(ConfigError, match="QCOMPILE_THREADS") as err:
        cpu.threads()
    assert err.value.next and "unset" in err.value.next
    monkeypatch.setenv("QCOMPILE_THREADS", " 3 ")
    assert cpu.threads() == 3
    monkeypatch.delenv("QCOMPILE_THREADS")
    assert cpu.threads() == torch.get_num_threads()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the events' library)")
def test_shards__each_task_on_its_own_pinned_thread_results_in_order():
    """The caller runs task 0 and a thread of the runner each other task (pinned to a CPU of
    its own where there are enough); results come back in order, call after call, from
    several calling threads at once; the caller's CPU set is restored."""
    import threading

    n = 2
    runner = cpu.Shards(n)
    allowed = frozenset(os.sched_getaffinity(0))
    gate = threading.Barrier(n)

    def task(i):
        gate.wait(timeout=10)        # every task on a thread of its own, at once
        return i, threading.get_ident(), frozenset(os.sched_getaffinity(0))

    got = runner.run([(task, (i,)) for i in range(n)])
    assert [g[0] for g in got] == list(range(n))
    assert len({g[1] for g in got}) == n and got[0][1] == threading.get_ident()
    if len(allowed) >= n:
        cpus = sorted(allowed)
        assert [g[2] for g in got] == [frozenset({c}) for c in cpus[:n]]
    assert frozenset(os.sched_getaffinity(0)) == allowed

    def caller(k):
        for r in range(20):
            out = runner.run([(lambda i, r=r: (k, r, i), (i,)) for i in range(n)])
            assert out == [(k, r, i) for i in range(n)]

    run_in_threads(caller, [(k,) for k in range(3)], timeout=60)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the events' library)")
@pytest.mark.parametrize("failing", [0, 1])
def test_shards__a_task_error_reaches_the_caller_after_every_task(failing):
    runner = cpu.Shards(2)
    finished = []

    def task(i):
        if i == failing:
            raise ValueError(f"shard {i} failed")
        time.sleep(0.05)
        finished.append(i)
        return i

    with pytest.raises(ValueError, match=f"shard {failing} failed"):
        runner.run([(task, (i,)) for i in range(2)])
    assert finished == [1 - failing]                 # the other shard ran to its end
    assert runner.run([(lambda i: i * 10, (i,)) for i in range(2)]) == [0, 10]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the events' library)")
def test_shards__a_forked_child_makes_its_own_threads():
    assert cpu._shards(2).run([(int, (i,)) for i in range(2)]) == [0, 1]
    pid = os.fork()
    if pid == 0:                                     # the child: the parent's threads are gone
        ok = cpu._shards(2).run([(int, (i,)) for i in range(2)]) == [0, 1]
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child's shards hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def _no_library():
    raise CompileError("cpu: qcompile's thread pool needs gcc", next="install gcc")


def test_data_parallel_shards__same_outputs_as_one_module(monkeypatch):
    """Batch 8 on 2 threads runs as two shards of 4 (compiled for that), each on its own
    local-sync context, and gives the batch-8 module's outputs; other batches run in pieces."""
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    q, _ = _quantized("add_relu", QuantizeConfig(quantizer="qcompile"))
    model = compile_cpu(q, CompileOptions(batch_sizes=(1, 8), analyze=False))
    assert sorted(model.runner.modules) == [1, 4, 8]
    x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(5))
    whole = model.runner.modules[8].module()(x.numpy())[0]
    got = model(x).numpy()
    np.testing.assert_array_equal(got, whole)
    assert len(model.runner.modules[4]._inline) == 2          # the two shard contexts ran
    np.testing.assert_array_equal(got, interpreter.run(model.runner.modules[8].graph,
                                                       x.numpy())[0])
    np.testing.assert_array_equal(model(x[:7]).numpy(), got[:7])   # 4 + 1 + 1 + 1
    # without the pool library's events the shards go through a thread-pool executor
    monkeypatch.setattr(cpu, "_SHARDS", {})
    monkeypatch.setattr(cpu.upool, "_library", _no_library)
    assert cpu._shards(2) is None
    np.testing.assert_array_equal(model(x).numpy(), got)
    monkeypatch.setenv("QCOMPILE_THREADS", "1")
    np.testing.assert_array_equal(model(x).numpy(), got)       # the batch-8 module itself

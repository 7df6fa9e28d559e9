"""qcompile's intra-op thread pool (``ukernel/pool.c``): every item of every dispatch runs
exactly once under the claim protocol; a model whose contractions are all microkernel dispatches
compiles to pooled modules that run inline on the pool, bit-exact with the reference at batch 1
and 4 (and as data-parallel shards); ``QCOMPILE_POOL=0`` keeps IREE's task system; a pooled
module survives an artifact round trip, and one whose pool flag was stripped is refused; the
per-dispatch profile runs a pooled module."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import threading
import zipfile

import numpy as np
import pytest
import torch
from concurrency import run_in_threads
from test_cpu_target import _assert_bit_exact
from torch import nn

import qcompile
from qcompile.bench import profile
from qcompile.codegen import cpu, ukernel
from qcompile.codegen.target import CompileOptions, compile_cpu
from qcompile.codegen.ukernel import pool
from qcompile.errors import ArtifactError, CompileError
from qcompile.frontend.quantize import QuantizeConfig, quantize

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
needs_vnni = pytest.mark.skipif(shutil.which("gcc") is None or not ukernel.host_has_vnni(),
                                reason="needs gcc and an AVX-512 VNNI host")

BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


@needs_gcc
@pytest.mark.parametrize("spin_ns", [200_000, 0])
def test_pool__every_item_of_every_dispatch_once(spin_ns):
    # (spin 0: the helpers sleep after every dispatch and are woken for the next)
    lib = pool._library()
    lib.qk_pool_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, BODY, ctypes.c_void_p]
    p = lib.qk_pool_new(3, spin_ns)
    # one helper per CPU this process may use, besides the caller's
    assert lib.qk_pool_helpers(p) == min(3, len(os.sched_getaffinity(0)) - 1)
    seen: list[int] = []
    lock = threading.Lock()

    def body(_arg, i):  # type: ignore[no-untyped-def]
        with lock:
            seen.append(int(i))

    cb = BODY(body)
    try:
        # (runs of items per claim: every length from 1 item to a large dispatch)
        for n in [0, 1, 2, 3, 7, 64, 1, 100, 5, 1000, 4097] * 4:
            seen.clear()
            lib.qk_pool_run(p, n, cb, None)
            assert sorted(seen) == list(range(n))
    finally:
        lib.qk_pool_free(ctypes.c_void_p(p))


@needs_gcc
def test_pool__operand_is_zero_for_one_thread():
    assert not pool.ctx(1).any()
    if len(os.sched_getaffinity(0)) < 2:
        assert not pool.ctx(2).any()                         # one CPU: no helper to pin
        return
    two = pool.ctx(2)
    assert two.shape == (ukernel.CTX_SIZE,) and two[0] and two[1]
    np.testing.assert_array_equal(pool.ctx(2), two)          # one pool per thread count


@pytest.mark.parametrize("value", ["-1", "1.5", "2ms", "fast"])
def test_spin_env__malformed_is_a_clear_error(monkeypatch, value):
    from qcompile.errors import ConfigError

    monkeypatch.setenv("QCOMPILE_SPIN_US", value)
    with pytest.raises(ConfigError, match="QCOMPILE_SPIN_US") as err:
        pool.spin_us()
    assert err.value.at == "environment variable QCOMPILE_SPIN_US" and "unset" in err.value.next
    if len(os.sched_getaffinity(0)) >= 2:
        with pytest.raises(ConfigError, match="QCOMPILE_SPIN_US"):
            pool.ctx(2)                        # the pool's maker reads it
    monkeypatch.setenv("QCOMPILE_SPIN_US", " 0 ")
    assert pool.spin_us() == 0
    monkeypatch.delenv("QCOMPILE_SPIN_US")
    assert pool.spin_us() == pool.SPIN_US


@needs_gcc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no helper to pin")
def test_pool__one_per_spin_time(monkeypatch):
    monkeypatch.setenv("QCOMPILE_SPIN_US", "0")
    zero = pool.ctx(2)
    monkeypatch.setenv("QCOMPILE_SPIN_US", "50")
    assert pool.ctx(2)[1] != zero[1]
    monkeypatch.setenv("QCOMPILE_SPIN_US", "0")
    np.testing.assert_array_equal(pool.ctx(2), zero)


class Net(nn.Module):
    """A stem, an expand → depthwise → project block with its residual, a 3×3 conv at
    stride 2 and a linear: every contraction a microkernel takes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU6())
        self.block = nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU6(),
                                   nn.Conv2d(64, 64, 3, 1, 1, groups=64), nn.ReLU6(),
                                   nn.Conv2d(64, 16, 1))
        self.down = nn.Sequential(nn.Conv2d(16, 72, 3, 2, 1), nn.ReLU())
        self.fc = nn.Linear(72, 10)

    def forward(self, x):
        y = self.stem(x)
        y = y + self.block(y)
        y = self.down(y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = Net().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(8, 3, 30, 26, generator=g),) for _ in range(3)]
    q = quantize(model, batches[0], batches, QuantizeConfig(quantizer="qcompile"))
    return q, batches[1][0]


@pytest.fixture(scope="module")
def pooled(quantized):
    q, _ = quantized
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QCOMPILE_THREADS", "2")
        return compile_cpu(q, CompileOptions(batch_sizes=(1, 4, 8), analyze=False))


@needs_vnni
def test_pooled_module__bit_exact_with_reference(pooled, quantized, monkeypatch):
    _, x = quantized
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    rep = pooled.report["compile"]["ukernel"]
    assert rep["stock"] == {}
    assert pooled.report["compile"]["pooled_batches"] == [1, 4, 8]
    assert all(m.pooled for m in pooled.runner.modules.values())
    if len(os.sched_getaffinity(0)) > 1:                           # the pool is in use
        assert pooled.runner.modules[1].module()._extra[0][0] != 0
    _assert_bit_exact(pooled, x)
    want = [pooled.runner.modules[1].module()(x[i:i + 1].numpy())[0] for i in range(8)]
    np.testing.assert_array_equal(pooled(x).numpy(), np.concatenate(want))   # 2 shards of 4


@needs_vnni
def test_pooled_module__takes_its_storage_and_returns_results_of_its_own(pooled, quantized,
                                                                         monkeypatch):
    """A pooled module's main takes the storage of its result and of its transients (made once
    per loaded module): results of one call stay as they were through the next call."""
    import iree.runtime as rt

    from qcompile.codegen import iree_cpu

    _, x = quantized
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    mod = pooled.runner.modules[1].module()
    reflection = mod._main.vm_function.reflection
    outputs, transients = iree_cpu.storage_args(reflection)
    assert outputs == [1 * 10 * 4] and transients is not None and transients > 0
    assert len(mod._storage) == 2 and isinstance(mod._storage[1], rt.HalBuffer)
    first = mod(x[:1].numpy())[0]
    kept = first.copy()
    second = mod(x[1:2].numpy())[0]
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)
    a, b = pooled(x[:1]), pooled(x[1:2])
    np.testing.assert_array_equal(a.numpy(), kept)
    assert not torch.equal(a, b)


def test_storage_args__sizes_from_main_declaration():
    from qcompile.codegen.iree_cpu import storage_args

    decl = ("sync func @main(%input0: tensor<2x3xf32>, %input1: tensor<4xi64>, %input2: "
            "tensor<2x10xf32> {iree.abi.output = 0 : index}, %input3: tensor<2x5xi8> "
            "{iree.abi.output = 1 : index}, %input4: !hal.buffer {iree.abi.transients = unit}) "
            "-> (%output0: tensor<2x10xf32>, %output1: tensor<2x5xi8>)")
    assert storage_args({"iree.abi.declaration": decl,
                         "iree.abi.transients.size.constant": "4096"}) == ([80, 10], 4096)
    plain = "sync func @main(%input0: tensor<2x3xf32>) -> (%output0: tensor<2x10xf32>)"
    assert storage_args({"iree.abi.declaration": plain}) == ([], None)
    with pytest.raises(ArtifactError, match="no constant size"):
        storage_args({"iree.abi.declaration": decl})


@needs_vnni
def test_pooled_module__calls_from_several_threads_at_once(pooled, quantized, monkeypatch):
    _, x = quantized
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    want = {n: pooled(x[:n]).numpy() for n in (1, 4)}   # two pooled modules on one pool

    def caller(n: int) -> None:
        for _ in range(20):
            np.testing.assert_array_equal(pooled(x[:n]).numpy(), want[n])

    run_in_threads(caller, [(1,), (4,), (1,)])


@needs_vnni
def test_pool_off__task_system_module_with_the_same_result(pooled, quantized, monkeypatch):
    q, x = quantized
    monkeypatch.setenv("QCOMPILE_POOL", "0")
    plain = compile_cpu(q, CompileOptions(batch_sizes=(1,), analyze=False))
    assert not plain.runner.modules[1].pooled
    assert "qk_pool" not in plain.runner.modules[1].mlir
    np.testing.assert_array_equal(plain(x[:1]).numpy(), pooled(x[:1]).numpy())


@needs_vnni
def test_pooled_artifact__round_trip_and_stripped_flag_refused(pooled, quantized, tmp_path):
    _, x = quantized
    path = pooled.save(tmp_path / "net.qca")
    loaded = qcompile.load(path)
    assert loaded.runner.modules[1].pooled
    assert torch.equal(loaded(x[:3]), pooled(x[:3]))
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["meta.json"])
    for m in meta["modules"].values():
        m.pop("pooled")
    members["meta.json"] = json.dumps(meta).encode()
    bad = tmp_path / "bad.qca"
    with zipfile.ZipFile(bad, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(ArtifactError, match="takes .*4 i64"):
        qcompile.load(bad)


@needs_vnni
def test_pooled_module__dispatch_profile(pooled, quantized):
    _, x = quantized
    prof = profile.dispatch_profile(pooled.runner.modules[1], [x[:1].numpy()], repetitions=2)
    assert prof["dispatches"] >= 5
    assert any(r["dispatch"].startswith("qk_conv") for r in prof["top"])


@needs_vnni
def test_pool_unavailable__warns_and_runs_on_one_thread(pooled, quantized, monkeypatch):
    _, x = quantized

    def no_pool(threads):  # type: ignore[no-untyped-def]
        if threads > 1:
            raise CompileError("cpu: qcompile's thread pool needs gcc", why="gcc not found")
        return np.zeros(ukernel.CTX_SIZE, np.int64)

    monkeypatch.setattr(pool, "ctx", no_pool)
    monkeypatch.setenv("QCOMPILE_THREADS", "2")
    m = cpu.BatchModule(1, pooled.runner.modules[1].vmfb, (), None, pooled=True)
    with pytest.warns(RuntimeWarning, match="thread pool needs gcc.*run on one thread"):
        mod = m.module()
    assert not mod._extra[0].any()
    np.testing.assert_array_equal(mod(x[:1].numpy())[0], pooled(x[:1]).numpy())


def test_pool_library__without_gcc_is_a_compile_error(monkeypatch):
    monkeypatch.setenv("QCOMPILE_CC", "no-such-compiler-qcompile")
    with pytest.raises(CompileError, match="thread pool needs gcc") as err:
        pool.build_library()
    assert "one thread" in err.value.next


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no pool to load")
def test_pool_library__that_does_not_load_is_a_compile_error(monkeypatch, tmp_path):
    bad = tmp_path / "pool-broken.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setattr(pool, "build_library", lambda: bad)
    monkeypatch.setattr(pool, "_LIB", None)
    with pytest.raises(CompileError, match="does not load") as err:
        pool.ctx(2)
    assert err.value.at == str(bad) and "rebuild" in err.value.next


def test_pool_wanted__env(monkeypatch):
    monkeypatch.delenv("QCOMPILE_POOL", raising=False)
    assert cpu.pool_wanted()
    monkeypatch.setenv("QCOMPILE_POOL", "0")
    assert not cpu.pool_wanted()

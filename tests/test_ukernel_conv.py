"""The standalone VNNI conv microkernel (qcompile/codegen/ukernel, not wired into the emitter):
bit-exact with the reference interpreter through IREE on small odd shapes. Skipped without gcc or
AVX-512 VNNI."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from qcompile.codegen import iree_cpu, ukernel
from qcompile.reference import interpreter

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or not ukernel.host_has_vnni(),
                                reason="needs gcc and an AVX-512 VNNI host")

_spec = importlib.util.spec_from_file_location(
    "ukernel_conv_bench", Path(__file__).resolve().parent.parent / "scripts" /
    "ukernel_conv_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("name", ["9x11x6-40-3x3s2+res", "7x7x5-19-1x1s1"])
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

"""Target ``cpu``: QIR after the pass pipeline → MLIR → IREE llvm-cpu, one module per compiled
batch size.

QIR is static-shaped, so each batch size in ``batch_sizes`` gets its own module (1 is always
among them). A call with another batch size runs in pieces of compiled sizes, largest first, and
the pieces' outputs are concatenated: any batch from 1 to ``max_batch`` runs, and results do not
depend on how a batch is split (each sample is computed on its own).

A batch of ``T · k`` samples (``T`` threads, ``k >= SHARD_MIN``) whose shard size ``k`` is
compiled runs data-parallel: ``T`` shards at once, each on its own IREE ``local-sync`` context
(inline in one thread, no task system), the caller running the first (:class:`Shards`). IREE's
task system pays a worker wake-up at every dispatch boundary (tens of µs on a VM, often more
when the host is busy); shards pay none. See :func:`shard_size`. Other batches whose every
contraction is a microkernel dispatch run as *pooled* modules: inline too, each dispatch shared
out over qcompile's own thread pool (:mod:`qcompile.codegen.ukernel.pool`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qcompile.codegen import emit_ukernel, iree_cpu, ukernel
from qcompile.codegen.mlir_emit import EmitOptions, emit
from qcompile.codegen.ukernel import pool as upool
from qcompile.errors import CompileError
from qcompile.ir.graph import Graph
from qcompile.ir.types import DType


@dataclass
class BatchModule:
    batch: int
    vmfb: bytes
    flags: tuple[str, ...]
    workaround: str | None
    graph: Graph | None = None        # None when loaded from an artifact
    mlir: str | None = None
    driver: str = "local-task"        # IREE runtime driver (hip, vulkan for the GPU targets)
    ukernel: dict[str, Any] | None = None   # the microkernel convs of this module
    pooled: bool = False              # runs inline, its dispatches on qcompile's thread pool
    # its microkernel quantize reads every f32 input and reports a NaN or infinity (pooled
    # modules): the caller's finiteness check is then made there (iree_cpu.Module)
    finite_check: bool = False
    _module: iree_cpu.Module | None = field(default=None, repr=False)
    _inline: list[iree_cpu.Module] = field(default_factory=list, repr=False)

    def module(self) -> iree_cpu.Module:
        if self._module is None:
            if self.pooled:
                self._module = self._local_sync(_pool_ctx())
            else:
                self._module = iree_cpu.Module(self.vmfb, self.driver)
        return self._module

    def inline(self, i: int) -> iree_cpu.Module:
        """The ``i``-th ``local-sync`` instance (one per data-parallel shard thread; a pooled
        module's shards keep their dispatches on their own thread)."""
        with _LOCK:
            while len(self._inline) <= i:
                self._inline.append(self._local_sync(upool.ctx(1)) if self.pooled else
                                    iree_cpu.Module(self.vmfb, "local-sync"))
            return self._inline[i]

    def _local_sync(self, ctx: np.ndarray) -> iree_cpu.Module:
        """A ``local-sync`` instance of this pooled module with the pool operand ``ctx`` (and
        its own non-finite input flag, ``ctx[2]``, where the kernel checks the inputs)."""
        flag = np.zeros(8, np.int64) if self.finite_check else None
        if flag is not None:
            ctx = ctx.copy()
            ctx[2] = flag.ctypes.data
        return iree_cpu.Module(self.vmfb, "local-sync", extra=(ctx,), nonfinite=flag)


def pool_wanted() -> bool:
    """Whether batches that do not run as shards get pooled modules (``QCOMPILE_POOL``, on
    unless ``0``)."""
    return os.environ.get("QCOMPILE_POOL", "1").strip() != "0"


def _pool_ctx() -> np.ndarray:
    """The pool operand for :func:`threads` threads; one thread (with a warning) when the
    pool cannot be built here."""
    try:
        return upool.ctx(threads())
    except CompileError as err:
        warnings.warn(f"{err.what}: {err.why}; pooled modules run on one thread",
                      RuntimeWarning, stacklevel=3)
        return upool.ctx(1)


SHARD_MIN = 4          # samples per data-parallel shard, at least
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def threads() -> int:
    """Threads qcompile's ``cpu`` target uses: ``QCOMPILE_THREADS``, else torch's intra-op
    thread count (what the benchmark gives every engine)."""
    env = os.environ.get("QCOMPILE_THREADS", "").strip()
    if not env:
        return max(1, torch.get_num_threads())
    if not env.isdigit() or int(env) < 1:
        from qcompile.errors import ConfigError

        raise ConfigError(f"QCOMPILE_THREADS={env!r} is not a thread count",
                          at="environment variable QCOMPILE_THREADS",
                          why="it must be a whole number of threads, 1 or more",
                          next="set it to e.g. 2, or unset it to use torch's thread count")
    return int(env)


def shard_size(batch: int, n_threads: int | None = None) -> int | None:
    """The per-thread batch when ``batch`` runs as data-parallel shards, or None: ``batch / T``
    when it divides evenly into shards of at least :data:`SHARD_MIN` samples (smaller batches
    keep one module on IREE's task system, so that their compile stays one module)."""
    t = threads() if n_threads is None else n_threads
    if t < 2 or batch % t or batch // t < SHARD_MIN:
        return None
    return batch // t


def _pool(n: int) -> ThreadPoolExecutor:
    """The shard threads, each pinned to a CPU of its own where the process may use at least
    ``n`` CPUs (:func:`_pinner`)."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL._max_workers < n:   # noqa: SLF001 - resize on demand
            _POOL = ThreadPoolExecutor(n, thread_name_prefix="qcompile-shard",
                                       initializer=_pinner(n))
        return _POOL


class Shards:
    """The data-parallel shards' threads: the caller runs shard 0 on the first of the process'
    CPUs, and ``n - 1`` threads of its own, each pinned to one of the next CPUs, run the others
    (nothing is pinned where the process may use fewer than ``n`` CPUs). Shards and results pass
    through events of qcompile's pool library (``pool.c``, ``qk_event_*``): a shard thread spins
    for :func:`~qcompile.codegen.ukernel.pool.spin_us` after its shard before it sleeps, and the
    caller spins for the others' results, so that a loop of calls never waits for a thread to
    wake. Calls are serialised."""

    def __init__(self, n: int) -> None:
        lib = upool._library()                 # noqa: SLF001 - CompileError where it cannot be
        self._wait, self._post = lib.qk_event_wait, lib.qk_event_post
        self._spin = upool.spin_us() * 1000
        self.n = n
        # 2n events of 64 bytes, 64-byte aligned: the threads' starts, then their results
        raw = np.zeros(2 * n * 16 + 16, np.uint32)
        skip = (-raw.ctypes.data % 64) // 4
        self._words = raw[skip:skip + 2 * n * 16].reshape(2 * n, 16)
        self._at = [self._words[i].ctypes.data for i in range(2 * n)]
        cpus = sorted(os.sched_getaffinity(0))
        self._cpus = cpus[:n] if len(cpus) >= n else None
        self._tasks: list[tuple[Callable[..., Any], tuple[Any, ...]] | None] = [None] * n
        self._out: list[tuple[bool, Any]] = [(True, None)] * n
        self._lock = threading.Lock()
        for i in range(1, n):
            threading.Thread(target=self._serve, args=(i,), name=f"qcompile-shard-{i}",
                             daemon=True).start()

    def _pin(self, i: int) -> None:
        """This thread onto the ``i``-th CPU (left as it is where that CPU is no longer the
        process' to use)."""
        if self._cpus is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {self._cpus[i]})

    def _serve(self, i: int) -> None:
        self._pin(i)
        seen = 0
        while True:
            seen = self._wait(self._at[i], seen, self._spin)
            task = self._tasks[i]
            try:
                self._out[i] = (True, task[0](*task[1]))  # type: ignore[index]
            except BaseException as err:     # re-raised by the caller  # noqa: BLE001
                self._out[i] = (False, err)
            # (no reference to the module kept while waiting: it lives as long as its model)
            task = None
            self._post(self._at[self.n + i])

    def run(self, tasks: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
        """``fn(*args)`` for each of the ``n`` tasks, the ``i``-th on the ``i``-th thread; the
        results in order, or the first task's exception."""
        n = self.n
        with self._lock:
            done = [int(self._words[n + i, 0]) for i in range(n)]
            self._tasks[:] = list(tasks)
            for i in range(1, n):
                self._post(self._at[i])
            before = os.sched_getaffinity(0) if self._cpus is not None else None
            try:
                self._pin(0)
                try:
                    self._out[0] = (True, tasks[0][0](*tasks[0][1]))
                except BaseException as err:  # noqa: BLE001 - after the others are done
                    self._out[0] = (False, err)
            finally:
                if before is not None:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(0, before)
                for i in range(1, n):
                    self._wait(self._at[n + i], done[i], self._spin)
            out = list(self._out)
            self._tasks[:] = [None] * n
            self._out[:] = [(True, None)] * n
        for ok, value in out:
            if not ok:
                raise value
        return [value for _, value in out]


_SHARDS: dict[int, Shards | None] = {}
# a forked child has none of the parent's threads: it makes its own on its first call
os.register_at_fork(after_in_child=_SHARDS.clear)


def _shards(n: int) -> Shards | None:
    """The process' :class:`Shards` for ``n`` threads; None where the pool library cannot be
    built (the shards then go through a thread-pool executor, :func:`_pool`)."""
    with _LOCK:
        if n not in _SHARDS:
            try:
                _SHARDS[n] = Shards(n)
            except CompileError:
                _SHARDS[n] = None
        return _SHARDS[n]


def _pinner(n: int) -> Callable[[], None]:
    """A thread initializer that pins each new shard thread to the next of the process' CPUs.

    Unpinned, a shard thread that sleeps between calls is woken by the caller onto the caller's
    CPU, and the scheduler at times leaves both shards on one core for the whole call:
    mobilenet_v2 at batch 8 (two shards of 4, one process, 10 alternating windows) measured
    10.2–10.8 ms in some windows and 18.6–19.5 in others unpinned, 10.1–11.5 in all but two
    pinned. Where the process may use fewer than ``n`` CPUs (``taskset``) nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < n:
        return lambda: None
    nxt = iter(cpus)
    lock = threading.Lock()

    def pin() -> None:
        with lock:
            cpu = next(nxt, None)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return pin


def compile_graph(graph: Graph, batch: int, *, keep_dir: str | Path | None = None,
                  uk: emit_ukernel.Support | None = None, winograd: bool = True
                  ) -> BatchModule:
    """Emit and compile ``graph``; on failure walk the workaround ladder:

    1. fast flags (data tiling + inner-tiled VNNI path);
    2. the same with dequantize epilogues in their own dispatch: IREE 3.13 turns a per-channel
       table read back into a broadcast operand when the rest of the epilogue folds away (a zero
       bias) and then crashes materializing the encoding;
    3. the flag sets of :data:`iree_cpu.WORKAROUNDS`: no inner-tiled path (contractions then
       emitted s8 × s8 for IREE's mmt4d ukernels, several times slower than the u8 path but far
       faster than untiled code), then no data tiling.

    With the VNNI conv microkernel (``uk.obj``), each step is tried with it first and then with
    the stock conv lowering (workaround ``stock-convs``)."""
    ladder = [(None, iree_cpu.FAST_FLAGS, EmitOptions()),
              ("split-dequant-epilogues", iree_cpu.FAST_FLAGS, EmitOptions(split_dequant=True)),
              *((name, flags, EmitOptions(s8_contractions=name == "no-inner-tiled"))
                for name, flags in iree_cpu.WORKAROUNDS)]
    texts: dict[EmitOptions, tuple[str, list[emit_ukernel.UkCall], dict[str, int]]] = {}
    errors: list[str] = []
    first: tuple[str, tuple[str, ...]] | None = None
    for workaround, extra, stock_opts in ladder:
        flags = (*iree_cpu.TARGET_FLAGS, *extra)
        tried_ukernel = False             # this step's microkernel module failed: stock convs
        for opts in ([replace(stock_opts, ukernel_convs=True, winograd=winograd)]
                     if uk and uk.obj else []) + \
                [stock_opts]:
            if opts not in texts:
                module, em = emit(graph, opts)
                texts[opts] = (module.operation.get_asm(enable_debug_info=True), em.uk_calls,
                               em.uk_stock, em.inputs_checked())
            text, calls, stock, checked = texts[opts]
            if opts.ukernel_convs and not calls:
                continue                  # nothing to lower: the stock try is the same module
            name = workaround
            # pooled when every contraction is a microkernel dispatch: what else runs there
            # (pads, pools, norms) then runs on the calling thread
            pooled = bool(calls) and not stock and pool_wanted()
            if calls:
                tried_ukernel = True
                try:
                    assert uk is not None and uk.obj is not None
                    text = emit_ukernel.link(text, calls, uk.obj, ukernel.host_target(flags),
                                             pooled)
                except CompileError as err:
                    errors.append(str(err))
                    continue
            elif tried_ukernel:
                name = "+".join(x for x in (workaround, "stock-convs") if x)
            first = first or (text, flags)
            got = iree_cpu.try_compile(text, flags)
            if isinstance(got, bytes):
                chains = [c for c in calls if c.quantize is None]
                locs = [loc for c in chains for loc in c.locs]
                info = {"chains": len(locs), "lowered": locs, "stock": stock,
                        "narrow_epilogue": sum(len(c.locs) for c in chains if c.narrow),
                        "input_quantize": len(calls) - len(chains),
                        "shared_input_dispatches": sum(c.multi is not None for c in chains),
                        "float_epilogue": sum(c.floating for c in chains),
                        "float_residual_adds": sum(c.floating and c.residual for c in chains),
                        "attention": sum(c.attention is not None for c in chains),
                        "table_epilogue": sum(c.lut for c in chains),
                        "depthwise": sum(c.depthwise for c in chains),
                        "winograd": sum(c.shape.wino for c in chains)}
                return BatchModule(batch, got, flags, name, graph, text, ukernel=info,
                                   pooled=pooled, finite_check=pooled and checked)
            errors.append(got)
    assert first is not None
    raise iree_cpu.failure(first[0], first[1], errors, keep_dir, f"{graph.name}.b{batch}")


def pieces(n: int, sizes: Sequence[int]) -> list[int]:
    """Split ``n`` into compiled batch sizes, largest first (``1`` must be compiled)."""
    out: list[int] = []
    for s in sorted(sizes, reverse=True):
        while n >= s:
            out.append(s)
            n -= s
    if n:
        raise ValueError(f"batch remainder {n} fits no compiled size {sorted(sizes)}")
    return out


def run_in_pieces(call: Callable[[int, list[np.ndarray]], list[np.ndarray]],
                  inputs: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    """Run ``call(size, piece_inputs)`` over the pieces of the batch; outputs concatenated."""
    n = int(inputs[0].shape[0])
    if n in sizes:
        return call(n, list(inputs))
    results: list[list[np.ndarray]] = []
    start = 0
    for size in pieces(n, sizes):
        results.append(call(size, [x[start:start + size] for x in inputs]))
        start += size
    return [np.concatenate(parts) for parts in zip(*results, strict=True)]


@dataclass
class OutputSpec:
    dtype: str                       # QIR dtype name of the graph output
    shape: tuple[int, ...]           # without the batch dimension

    def to_torch(self, raw: np.ndarray) -> torch.Tensor:
        if self.dtype == DType.U8.value:
            raw = raw.view(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(raw))


class CpuRunner:
    """Torch tensors in → pieces through the per-batch IREE modules → torch tensors out."""

    def __init__(self, modules: dict[int, BatchModule], outputs: list[OutputSpec]) -> None:
        self.modules, self.outputs = modules, outputs

    @property
    def checks_finite(self) -> bool:
        """Whether every module's kernels check the float inputs for NaN and infinity
        (``BatchModule.finite_check``; a hit raises :class:`NonFiniteInput`)."""
        return all(m.finite_check for m in self.modules.values())

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        return run_in_pieces(self._run, inputs, list(self.modules))

    def _run(self, size: int, xs: list[np.ndarray]) -> list[np.ndarray]:
        k = shard_size(size)
        mod = self.modules[size]
        if k is None or k not in self.modules or mod.driver != "local-task":
            return mod.module()(*xs)
        shard, n = self.modules[k], size // k
        tasks = [(shard.inline(i), tuple(x[i * k:(i + 1) * k] for x in xs)) for i in range(n)]
        threads = _shards(n)
        if threads is not None:
            parts = threads.run(tasks)
        else:
            pool = _pool(n)
            parts = [f.result() for f in [pool.submit(fn, *args) for fn, args in tasks]]
        return [np.concatenate(p) for p in zip(*parts, strict=True)]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self._to_torch(self.run_numpy(*[x.detach().contiguous().numpy() for x in inputs]))

    def _to_torch(self, raw: Sequence[np.ndarray]) -> Any:
        """The modules' outputs as torch tensors: one tensor, or a tuple for several."""
        outs = [spec.to_torch(r) for spec, r in zip(self.outputs, raw, strict=True)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def plain_call(self, signature: Sequence[Any]) -> Callable[[tuple[Any, ...]], Any] | None:
        """The call :class:`~qcompile.runtime.compiled.CompiledModel` makes for inputs that
        plainly fit ``signature``: each a ``torch.Tensor`` (not a subclass) on the CPU, dense
        and contiguous, of the compiled dtype and shape, all of one batch size that has a module
        of its own and never runs as shards (below ``2 * SHARD_MIN``). Those go straight to
        the module; anything else answers NotImplemented (the full path then checks it). None
        (no plain call) for token models with several sequence lengths, and where a float
        input is not checked for NaN and infinity by the kernels."""
        if any(s.seq_lens for s in signature) or (
                any(s.dtype.is_floating_point for s in signature) and not self.checks_finite):
            return None
        whole = {b: m for b, m in self.modules.items() if b < 2 * SHARD_MIN}
        dims = [(s.dtype, torch.Size(s.shape)) for s in signature]
        count, strided, tensor = len(signature), torch.strided, torch.Tensor

        def call(inputs: tuple[Any, ...]) -> Any:
            if len(inputs) != count:
                return NotImplemented
            arrays = []
            batch = None
            for x, (dtype, shape) in zip(inputs, dims, strict=True):
                if type(x) is not tensor or x.layout is not strided or x.is_nested or \
                        not x.is_cpu or x.dtype is not dtype or x.shape[1:] != shape or \
                        not x.is_contiguous() or (batch is not None and x.shape[0] != batch):
                    return NotImplemented
                batch = x.shape[0]
                arrays.append(x.detach().numpy())
            module = whole.get(batch)
            if module is None:
                return NotImplemented
            return self._to_torch(module.module()(*arrays))

        return call


def build(graphs: dict[int, Graph], *, keep_dir: str | Path | None = None,
          ukernel_convs: bool | None = None, winograd: bool = True
          ) -> tuple[CpuRunner, dict[str, Any]]:
    """Compile one module per batch size; returns the runner and a compile report.
    ``ukernel_convs``: the VNNI conv microkernel (None: where the host supports it);
    ``winograd``: its 3x3 stride-1 convs as Winograd F(4x4, 3x3) where they fit."""
    modules: dict[int, BatchModule] = {}
    times: dict[str, float] = {}
    uk = emit_ukernel.support(ukernel_convs)
    for batch, graph in sorted(graphs.items()):
        t0 = time.perf_counter()
        modules[batch] = compile_graph(graph, batch, keep_dir=keep_dir, uk=uk,
                                       winograd=winograd)
        times[str(batch)] = round(time.perf_counter() - t0, 3)
    first = graphs[min(graphs)]
    outputs = [OutputSpec(o.dtype.value, tuple(o.shape[1:])) for o in first.outputs]
    report = {"batch_sizes": sorted(modules), "compile_s_per_batch": times,
              "workarounds": {str(b): m.workaround for b, m in modules.items() if m.workaround},
              "flags": list(modules[min(modules)].flags),
              "ukernel": ukernel_report(uk, modules),
              "pooled_batches": sorted(b for b, m in modules.items() if m.pooled)}
    return CpuRunner(modules, outputs), report


def ukernel_report(uk: emit_ukernel.Support, modules: dict[int, BatchModule]) -> dict[str, Any]:
    """``used``, ``why`` (not), the count of chains (conv or linear → requantize) lowered per
    batch size, and for the largest batch which took it, how many of those requantize in 32-bit
    lanes (``narrow_epilogue``), whether the model input is quantized by the microkernel
    straight into the first conv's padded input (``input_quantize``), how many dispatches run
    several linears that share their input (``shared_input_dispatches``: attention's q, k, v),
    how many linears dequantize to f32 in the kernel (``float_epilogue``: a residual stream kept
    float) and add their residual there (``float_residual_adds``), how many attention chains
    run as one fused dispatch (``attention``), how many chains store the table of the
    elementwise op after them (``table_epilogue``: GELU), how many are depthwise convs
    (``depthwise``), how many convs run as Winograd F(4x4, 3x3) (``winograd``), and why the
    others kept the stock lowering."""
    infos = {b: m.ukernel for b, m in modules.items() if m.ukernel is not None}
    counts = {str(b): i["chains"] for b, i in sorted(infos.items())}
    used = any(counts.values())
    why = uk.why
    if uk.obj is not None and not used:
        failed = any("stock-convs" in (m.workaround or "") for m in modules.values())
        why = ("it failed to compile; the stock lowering is used (see workarounds)" if failed
               else "no conv or linear chain here is one the microkernel supports")
    out: dict[str, Any] = {"used": used, "why": why, "chains": counts}
    if infos:
        last = infos[max(infos)]
        out.update(lowered=last["lowered"], stock=last["stock"],
                   narrow_epilogue=last.get("narrow_epilogue", 0),
                   input_quantize=last.get("input_quantize", 0),
                   shared_input_dispatches=last.get("shared_input_dispatches", 0),
                   float_epilogue=last.get("float_epilogue", 0),
                   float_residual_adds=last.get("float_residual_adds", 0),
                   attention=last.get("attention", 0),
                   table_epilogue=last.get("table_epilogue", 0),
                   depthwise=last.get("depthwise", 0),
                   winograd=last.get("winograd", 0))
    return out

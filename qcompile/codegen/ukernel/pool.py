"""qcompile's intra-op thread pool (``pool.c``) for pooled modules.

A pooled module (target ``cpu``, batches that do not run as data-parallel shards) runs inline on
the calling thread (IREE ``local-sync``), and each microkernel dispatch shares its workgroups out
over this pool: the caller plus ``threads - 1`` helpers that spin between dispatches. IREE's task
system instead wakes its workers at every dispatch boundary, which at batch 1 costs more than
many of the dispatches themselves.

After its last workgroup a helper spins for :func:`spin_us` microseconds (``QCOMPILE_SPIN_US``,
default :data:`SPIN_US`) before it sleeps: long enough to span the gap between the calls of a
loop, so that the next call does not wait for a helper to wake (on a VM whose host gives an idle
vCPU away, that wake-up is what a busy host makes slow).

The pool reaches the kernels as a small i64 operand of each dispatch (:func:`ctx`):
``{qk_pool_run, pool, 0, 0}``; zeros run every workgroup on the calling thread. The library is
built from source by gcc, like the kernel object, and cached next to it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from qcompile.codegen.ukernel import CTX_SIZE, gcc_build
from qcompile.errors import CompileError

SOURCE = Path(__file__).with_name("pool.c")
SPIN_US = 2000          # a helper's spin after its last workgroup, by default (QCOMPILE_SPIN_US)
CFLAGS = ("-O2", "-fPIC", "-shared", "-pthread")

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_POOLS: dict[tuple[int, int], int] = {}


def spin_us() -> int:
    """How long a helper spins after its last workgroup before it sleeps, in microseconds:
    ``QCOMPILE_SPIN_US`` (a whole number; 0 sleeps at once), else :data:`SPIN_US`. Read when a
    pool is made (the first pooled call of a thread count)."""
    env = os.environ.get("QCOMPILE_SPIN_US", "").strip()
    if not env:
        return SPIN_US
    if not env.isdigit():
        from qcompile.errors import ConfigError

        raise ConfigError(f"QCOMPILE_SPIN_US={env!r} is not a time in microseconds",
                          at="environment variable QCOMPILE_SPIN_US",
                          why="it must be a whole number of microseconds, 0 or more",
                          next=f"set it to e.g. {SPIN_US}, 0 to let helpers sleep at once, or "
                               "unset it")
    return int(env)


def build_library() -> Path:
    """The pool's shared library, compiled by gcc once per source/flags (CompileError without
    gcc or when gcc fails)."""
    return gcc_build(SOURCE, CFLAGS, "pool-{key}.so", "qcompile's thread pool",
                     "pooled modules then run their dispatches on one thread")


def _library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        path = build_library()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as err:
            raise CompileError("cpu: qcompile's thread pool library does not load",
                               at=str(path), why=str(err),
                               next="delete it to rebuild it (pooled modules run on one "
                                    "thread meanwhile)") from err
        lib.qk_pool_new.restype = ctypes.c_void_p
        lib.qk_pool_new.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.qk_pool_helpers.restype = ctypes.c_int
        lib.qk_pool_helpers.argtypes = [ctypes.c_void_p]
        lib.qk_event_wait.restype = ctypes.c_uint32          # the shards' hand-offs (cpu.Shards)
        lib.qk_event_wait.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64]
        lib.qk_event_post.argtypes = [ctypes.c_void_p]
        _LIB = lib
    return _LIB


def ctx(threads: int) -> np.ndarray:
    """The pooled dispatches' operand for ``threads`` threads (the caller and ``threads - 1``
    helpers, each helper pinned to a CPU of its own; one pool per count and spin time for the
    process); zeros (one thread) for ``threads < 2`` or a process allowed one CPU. Raises
    :class:`CompileError` when the pool cannot be built, ``ConfigError`` for a malformed
    ``QCOMPILE_SPIN_US``."""
    out = np.zeros(CTX_SIZE, np.int64)
    threads = min(threads, len(os.sched_getaffinity(0)))
    if threads < 2:
        return out
    key = (threads, spin_us())
    with _LOCK:
        lib = _library()
        if key not in _POOLS:
            pool = lib.qk_pool_new(threads - 1, key[1] * 1000)
            if not pool or lib.qk_pool_helpers(pool) < 1:
                raise CompileError("cpu: qcompile's thread pool could not start its threads",
                                   why=f"pthread_create failed for {threads - 1} helper(s)",
                                   next="set QCOMPILE_THREADS=1 or free system resources")
            _POOLS[key] = pool
        run = ctypes.cast(lib.qk_pool_run, ctypes.c_void_p).value
        out[0], out[1] = run, _POOLS[key]
    return out

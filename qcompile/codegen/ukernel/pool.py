"""qcompile's intra-op thread pool (``pool.c``) for pooled modules.

A pooled module (target ``cpu``, batches that do not run as data-parallel shards) runs inline on
the calling thread (IREE ``local-sync``), and each microkernel dispatch shares its workgroups out
over this pool: the caller plus ``threads - 1`` helpers that spin between dispatches. IREE's task
system instead wakes its workers at every dispatch boundary, which at batch 1 costs more than
many of the dispatches themselves.

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
CFLAGS = ("-O2", "-fPIC", "-shared", "-pthread")

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_POOLS: dict[int, int] = {}


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
        lib.qk_pool_new.argtypes = [ctypes.c_int]
        lib.qk_pool_helpers.restype = ctypes.c_int
        lib.qk_pool_helpers.argtypes = [ctypes.c_void_p]
        _LIB = lib
    return _LIB


def ctx(threads: int) -> np.ndarray:
    """The pooled dispatches' operand for ``threads`` threads (the caller and ``threads - 1``
    helpers, each helper pinned to a CPU of its own; one pool per count for the process); zeros
    (one thread) for ``threads < 2`` or a process allowed one CPU. Raises
    :class:`CompileError` when the pool cannot be built."""
    out = np.zeros(CTX_SIZE, np.int64)
    threads = min(threads, len(os.sched_getaffinity(0)))
    if threads < 2:
        return out
    with _LOCK:
        lib = _library()
        if threads not in _POOLS:
            pool = lib.qk_pool_new(threads - 1)
            if not pool or lib.qk_pool_helpers(pool) < 1:
                raise CompileError("cpu: qcompile's thread pool could not start its threads",
                                   why=f"pthread_create failed for {threads - 1} helper(s)",
                                   next="set QCOMPILE_THREADS=1 or free system resources")
            _POOLS[threads] = pool
        run = ctypes.cast(lib.qk_pool_run, ctypes.c_void_p).value
        out[0], out[1] = run, _POOLS[threads]
    return out

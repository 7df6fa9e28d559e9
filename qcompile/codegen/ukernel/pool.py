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
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from qcompile.codegen.ukernel import CTX_SIZE, cache_dir
from qcompile.errors import CompileError

SOURCE = Path(__file__).with_name("pool.c")
CFLAGS = ("-O2", "-fPIC", "-shared", "-pthread")

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_POOLS: dict[int, int] = {}


def build_library() -> Path:
    """The pool's shared library, compiled by gcc once per source/flags (CompileError without
    gcc or when gcc fails)."""
    gcc = shutil.which(os.environ.get("QCOMPILE_CC", "gcc"))
    if gcc is None:
        raise CompileError("cpu: qcompile's thread pool needs gcc", why="gcc not found on PATH",
                           next="install gcc or set QCOMPILE_CC (pooled modules then run "
                                "their dispatches on one thread)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((gcc, *CFLAGS)).encode()).hexdigest()[:16]
    out = cache_dir() / f"pool-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qcompile-pool-") as tmp:
        lib = Path(tmp) / "pool.so"
        proc = subprocess.run([gcc, *CFLAGS, str(SOURCE), "-o", str(lib)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise CompileError("cpu: gcc failed on qcompile's thread pool",
                               why=proc.stderr[-2000:], next="check the gcc installation")
        os.replace(lib, out)
    return out


def _library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build_library()))
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

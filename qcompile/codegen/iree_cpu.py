"""``iree-compile`` for the host CPU and loading of the compiled modules.

Flags (see the IREE int8 study): llvm-cpu for the host, data tiling with the inner-tiled VNNI
path (u8 × s8 → ``vpdpbusd``) and its LLVM ukernels, padding fused into its consumer. Weights are
module constants, so their packing is hoisted into initializers and runs once at load.

IREE 3.13's inner-tiled path is experimental and fails on some shapes. A failed compile is retried
with the workarounds of :func:`qcompile.codegen.cpu.compile_graph`, in order; the one that worked
is reported. When every attempt fails the MLIR is saved and the error names it with the exact
``iree-compile`` command.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from qcompile.errors import CompileError
from qcompile.signals import signals_held

TARGET_FLAGS = (
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
    # Command buffers recorded at each call, not memoized once as indirect command buffers:
    # IREE 3.13 records those on the first call (module.__init), and that failed twice in 6
    # resnet50 bench processes with "INVALID_ARGUMENT; ref type mismatch; while invoking
    # native function hal.command_buffer.execution_barrier" (never outside the bench: not in
    # thousands of loads and first calls, also concurrent ones); iree-org/iree#24753 reports
    # failures of the same path since 3.12. Recording per call costs nothing measurable here
    # (batch 1, 2 threads: mobilenet_v2 1.43 ms either way, resnet18 5.06 / 5.07 ms).
    "--iree-hal-indirect-command-buffers=false",
)
FAST_FLAGS = (
    "--iree-opt-data-tiling",
    "--iree-llvmcpu-enable-inner-tiled",
    "--iree-llvmcpu-enable-llvm-ukernels=inner_tiled",
    "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops",
)
# (name, flags replacing FAST_FLAGS) tried in order after the fast configuration fails
WORKAROUNDS = (
    ("no-inner-tiled", ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all",
                        "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops")),
    ("no-data-tiling", ("--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops",)),
)
COMPILE_TIMEOUT_S = 900


def iree_compile_path() -> str:
    from iree.compiler.tools import binaries

    return binaries.find_tool("iree-compile")


def try_compile(mlir: str, flags: tuple[str, ...]) -> bytes | str:
    """The vmfb, or iree-compile's error output."""
    with tempfile.TemporaryDirectory(prefix="qcompile-") as tmp:
        src, out = Path(tmp) / "m.mlir", Path(tmp) / "m.vmfb"
        src.write_text(mlir, encoding="utf-8")
        proc = _run([iree_compile_path(), str(src), "-o", str(out), *flags])
        if proc.returncode == 0:
            return out.read_bytes()
        return proc.stderr.strip() or f"iree-compile exited with {proc.returncode}"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``argv`` to completion. Interrupted (Ctrl-C, SIGTERM as an exception, a timeout), the child
    is killed and reaped before this returns or raises: no compiler outlives qcompile, not even as
    a zombie (``subprocess.run`` leaves one on KeyboardInterrupt). Signals are held while the
    child starts: one landing inside ``Popen`` (it waits for the exec) would leave the started
    child with no one to reap it."""
    proc: subprocess.Popen[str] | None = None
    try:
        with signals_held():
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        assert proc is not None
        proc.kill()
        proc.communicate()
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {COMPILE_TIMEOUT_S}s")
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def failure(mlir: str, flags: tuple[str, ...], errors: list[str], keep_dir: str | Path | None,
            name: str) -> CompileError:
    """The error of a compile that no attempt could make: the MLIR saved, the command given."""
    where = Path(keep_dir if keep_dir is not None else ".")
    where.mkdir(parents=True, exist_ok=True)
    saved = where / f"{name}.failed.mlir"
    saved.write_text(mlir, encoding="utf-8")
    argv = [iree_compile_path(), str(saved), "-o", str(where / f"{name}.vmfb"), *flags]
    first = errors[0].splitlines() if errors else ["(no output)"]
    return CompileError("iree-compile failed for target cpu", at=str(saved),
                        why="\n".join(first[:12]),
                        next=f"reproduce with: {shlex.join(argv)}")


def compile_to_flow(mlir: str, flags: tuple[str, ...]) -> str:
    """The flow-level IR (dispatch regions) with debug locations, for the kernel analysis."""
    with tempfile.TemporaryDirectory(prefix="qcompile-") as tmp:
        src = Path(tmp) / "m.mlir"
        src.write_text(mlir, encoding="utf-8")
        proc = _run([iree_compile_path(), str(src), "--compile-to=flow",
                     "--mlir-print-debuginfo", *flags])
        if proc.returncode != 0:
            raise CompileError("iree-compile --compile-to=flow failed", why=proc.stderr[:2000])
        return proc.stdout


class Module:
    """A loaded vmfb: ``main`` called with numpy arrays. Calls are serialised (one IREE context
    per module; its task system already uses every core)."""

    def __init__(self, vmfb: bytes, driver: str = "local-task",
                 extra: tuple[np.ndarray, ...] = (), nonfinite: np.ndarray | None = None
                 ) -> None:
        import iree.runtime as rt

        self._extra = extra        # trailing arguments of every call (a pooled module's pool)
        # set by the kernel's input quantize when an input holds a NaN or an infinity
        self._nonfinite = nonfinite
        self._config = rt.Config(device=_device(driver)) if driver == "local-sync" else \
            rt.Config(driver)
        try:
            vm = rt.VmModule.copy_buffer(self._config.vm_instance, vmfb)
        except (RuntimeError, ValueError) as err:
            from qcompile.errors import ArtifactError

            raise ArtifactError("cannot load the compiled IREE module", why=str(err)[:500],
                                next="recompile the model (qcompile compile RECIPE -o ...)"
                                ) from err
        self._ctx = rt.SystemContext(config=self._config)
        self._ctx.add_vm_module(vm)
        self._main = self._ctx.modules.module["main"]
        self._lock = threading.Lock()
        # host-memory drivers read large inputs in place (imported, not copied), and are
        # called through the VM directly (Module._call_direct)
        self._host = driver in ("local-sync", "local-task")
        self._vm = (self._ctx.vm_context, self._main.vm_function) if self._host else None
        # the trailing operands as device buffers made once (they are the same every call)
        self._extra_views = [self._copy_in(x) for x in extra] if self._host else []
        # the storage a module compiled for it takes after them (its results', its
        # transients'): made once, so that a call allocates nothing and runs inline
        self._storage = self._caller_storage(self._main.vm_function.reflection)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        with self._lock:
            if self._nonfinite is not None:
                self._nonfinite[0] = 0
            args = [np.ascontiguousarray(x) for x in inputs]
            if self._vm:
                outs = self._call_direct(args)
            else:
                out = self._main(*(self._in_place(x) for x in args), *self._extra)
                outs = [_owned(np.asarray(o.to_host()))
                        for o in (out if isinstance(out, list | tuple) else [out])]
            if self._nonfinite is not None and self._nonfinite[0]:
                from qcompile.errors import NonFiniteInput

                raise NonFiniteInput()
            return outs

    def _call_direct(self, args: list[np.ndarray]) -> list[np.ndarray]:
        """``main`` invoked on the VM with argument and result lists built here, the results
        copied out of their mapped host buffers. The runtime's generic invoker converts every
        argument and wraps every result in Python objects: about 15 µs more a call, after the
        kernels have left Python's data out of the caches."""
        import iree.runtime as rt

        views = []
        for x in args:
            view = self._in_place(x)
            views.append(self._copy_in(x) if isinstance(view, np.ndarray) else view)
        arg_list = rt.VmVariantList(len(views) + len(self._extra_views) + len(self._storage))
        for view in (*views, *self._extra_views, *self._storage):
            arg_list.push_ref(view)
        ret_list = rt.VmVariantList(1)
        vm_context, function = self._vm
        vm_context.invoke(function, arg_list, ret_list)
        outs = []
        for i in range(ret_list.size):
            view = ret_list.get_as_object(i, rt.HalBufferView)
            dtype = rt.HalElementType.map_to_dtype(view.element_type)
            outs.append(np.array(view.map().asarray(view.shape, dtype)))   # a copy we own
        return outs

    def _caller_storage(self, reflection: dict[str, str]) -> list[Any]:
        """Buffers for ``main``'s caller-provided storage (see :func:`storage_args`), in its
        argument order; none for a module without it."""
        outputs, transients = storage_args(reflection)
        if not outputs and transients is None:
            return []
        if not self._host:
            raise ValueError("a module that takes its results' and transients' storage runs on "
                             "the host drivers only (local-sync, local-task)")
        import iree.runtime as rt

        device = self._config.device

        def buffer(size: int) -> Any:
            return device.allocator.allocate_buffer(
                memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
                allocation_size=max(size, 64))

        # main checks only the byte length of an output's buffer; its result views it anew
        views = [rt.HalBufferView(buffer(n), [n], rt.HalElementType.INT_8) for n in outputs]
        return [*views, buffer(transients)] if transients is not None else views

    def _copy_in(self, x: np.ndarray) -> Any:
        """``x`` copied into a device buffer view of its own."""
        import iree.runtime as rt

        kind = rt.array_interop.map_dtype_to_element_type(x.dtype)
        if kind is None:
            raise ValueError(f"no IREE element type for numpy dtype {x.dtype}")
        device = self._config.device
        return device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
            device=device, buffer=np.ascontiguousarray(x), element_type=kind)

    def _in_place(self, x: np.ndarray) -> Any:
        """``x`` as a buffer view of its own memory where the device is the host's and ``x`` is
        large, writable and 64-byte aligned (IREE's binding alignment); else ``x`` itself, which
        IREE copies into a buffer of its own (a 600 KB image: about 20 µs)."""
        if not self._host or x.nbytes < IN_PLACE_BYTES or x.ctypes.data % 64 or \
                not x.flags.writeable:
            return x
        import iree.runtime as rt

        kind = rt.array_interop.map_dtype_to_element_type(x.dtype)
        if kind is None:
            return x
        buf = self._config.device.allocator.import_host_allocation(
            x, memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT)
        return rt.HalBufferView(buf, x.shape, kind)


def storage_args(reflection: dict[str, str]) -> tuple[list[int], int | None]:
    """From ``main``'s reflection: the byte size of each result whose storage the caller
    provides (``iree.abi.output``, in result order) and the size of the transient storage it
    takes (``iree.abi.transients``; None: it takes none)."""
    declared = reflection.get("iree.abi.declaration", "")
    outputs = {int(k): _tensor_bytes(t) for t, k in OUTPUT_ARG.findall(declared)}
    transients = None
    if "iree.abi.transients" in declared.partition("->")[0]:
        size = reflection.get("iree.abi.transients.size.constant")
        if size is None:
            from qcompile.errors import ArtifactError

            raise ArtifactError("the module's transient storage has no constant size",
                                why="main takes its transients' storage but declares no "
                                    "iree.abi.transients.size.constant",
                                next="recompile the model (qcompile compile RECIPE -o ...)")
        transients = int(size)
    return [outputs[k] for k in sorted(outputs)], transients


# an argument of main that is the storage of result k (iree.abi.output): (its type, k)
OUTPUT_ARG = re.compile(r"(tensor<[^>]*>) \{iree\.abi\.output = (\d+) : index\}")


def _tensor_bytes(t: str) -> int:
    """Bytes of a static ``tensor<AxBx...xTYPE>`` (i1 as a byte)."""
    *dims, elem = t[len("tensor<"):-1].split("x")
    width = re.match(r"[a-z]+(\d+)", elem)
    bits = int(width.group(1)) if width else 8
    return int(np.prod([int(d) for d in dims], dtype=np.int64)) * max(1, -(-bits // 8))


IN_PLACE_BYTES = 1 << 16      # inputs from this size on are read in place (Module._in_place)


def _owned(a: np.ndarray) -> np.ndarray:
    """``a`` where it owns its memory (IREE's host transfer into a fresh array), else a copy
    (a view of a mapped device buffer)."""
    return a if a.base is None and a.flags.owndata else a.copy()


_DEVICES: dict[str, Any] = {}


def _device(driver: str) -> Any:
    """The process's ``driver`` device with a caching allocator: a call's transient buffers
    (and its input's) are reused, not allocated and zeroed again each call (1.9 MB per
    resnet18 call at batch 1)."""
    import iree.runtime as rt

    with _DEVICE_LOCK:
        if driver not in _DEVICES:
            _DEVICES[driver] = rt.get_driver(driver).create_default_device(
                allocators=["caching"])
        return _DEVICES[driver]


_DEVICE_LOCK = threading.Lock()

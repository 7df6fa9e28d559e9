"""Loads :mod:`qcompile.codegen.triton.kernels` compiled or interpreted, in one process.

``triton.jit`` decides at decoration time whether a function is compiled (``JITFunction``) or
run by Triton's CPU interpreter (``InterpretedFunction``, when ``TRITON_INTERPRET`` is set), and
a kernel calls its helpers through its module's globals. So each mode gets its own copy of the
kernels module, executed with the interpreter knob forced on or off: the interpreted copy runs
bit-exactness checks on the CPU while the compiled copy is compiled ahead of time for sm_80 /
sm_90 (or launched on a GPU), from the same source file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import cache
from types import ModuleType

from qcompile.errors import TargetUnavailableError

_SOURCE = os.path.join(os.path.dirname(__file__), "kernels.py")


def triton_missing() -> str | None:
    """Why Triton cannot be imported here (``None`` when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"Triton is not installed ({err}); install the extra: pip install 'qcompile[cuda]'"
    return None


@cache
def kernels(interpret: bool) -> ModuleType:
    """The kernels module, its functions compiled (``interpret=False``) or interpreted."""
    name = f"qcompile.codegen.triton._kernels_{'interpreted' if interpret else 'compiled'}"
    return load_source(_SOURCE, name, interpret)


def load_source(path: str, name: str, interpret: bool) -> ModuleType:
    """The kernels file at ``path`` executed as module ``name`` (the reproducers of
    :mod:`qcompile.codegen.triton.repro` load the copy of it they carry)."""
    missing = triton_missing()
    if missing:
        raise TargetUnavailableError("target 'cuda' needs Triton", at="target cuda", why=missing,
                                     next="pip install 'qcompile[cuda]'")
    import triton

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module._interpreted = interpret  # type: ignore[attr-defined]
    sys.modules[name] = module      # inspect.getsource (used by both modes) looks modules up
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    return module


def is_interpreted(module: ModuleType) -> bool:
    """Whether ``module`` is a copy of the kernels loaded for Triton's interpreter."""
    return bool(getattr(module, "_interpreted", False))


def source_text() -> str:
    """The kernels file, as a reproducer carries it."""
    with open(_SOURCE, encoding="utf-8") as f:
        return f.read()

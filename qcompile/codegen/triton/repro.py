"""Reproducers of Triton failures: ``python -m qcompile.codegen.triton.repro FILE.json``.

A launch Triton could not compile (ahead of time, :func:`.aot.compile_launch`, or at its first
launch on a GPU) or that failed in the interpreter is saved as one JSON file in
``compile.keep_dir`` (else the run's output folder, else the current folder), and the
``CompileError`` prints the command that reruns it. The file is self-contained:

=================================  ==============================================================
key                                what
=================================  ==============================================================
``format``, ``version``            ``qcompile-triton-repro``, 1
``kernel``, ``step``, ``loc``      the kernel, the chain it computes and the chain's source location
``signature``, ``constexprs``,     ``ASTSource(fn, signature, constexprs, attrs)``; ``attrs`` as
``attrs``                          ``[[arg index], [[name, value], ...]]`` pairs
``num_warps``, ``num_stages``,     the ``options`` of ``triton.compile``
``options``
``target``                         ``GPUTarget(backend, arch, warp_size)``
``grid``, ``tile``                 the launch grid and tile (for reading; the compile ignores them)
``failed_in``, ``error``           ``compile``, ``launch`` or ``interpreter``; Triton's message
``ttir``                           the TTIR, when Triton got that far (else ``null``)
``triton_output``                  what Triton printed meanwhile (a ptxas failure prints the PTX)
``source``, ``source_sha256``      the kernels module the kernel was compiled from
``triton_version``                 the Triton that failed
=================================  ==============================================================

The command loads the ``source`` it carries (Python: run only reproducers you trust) and calls
``triton.compile`` exactly as :func:`compile_spec` did when it failed; it exits 0 when the
kernel compiles, 1 with Triton's error when it still fails, 2 when the file is unusable.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shlex
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qcompile.codegen.triton import loader
from qcompile.errors import ArtifactError, CompileError

FORMAT, VERSION = "qcompile-triton-repro", 1
WHY_LINES = 12
_QUIET = threading.RLock()     # re-entered by a failure inside a quiet compile
# key -> type every reproducer must have (the rest is for reading)
REQUIRED: dict[str, type] = {
    "format": str, "version": int, "kernel": str, "signature": dict, "constexprs": dict,
    "attrs": list, "num_warps": int, "num_stages": int, "options": dict, "target": dict,
    "source": str, "source_sha256": str}


def compile_spec(spec: dict[str, Any], fn: Any) -> Any:
    """``triton.compile`` of ``spec`` (see the table above) with kernel ``fn``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {tuple(index): list(values) for index, values in spec["attrs"]}
    src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                    attrs=attrs)
    t = spec["target"]
    options = {"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
               **spec["options"]}
    return triton.compile(src, target=GPUTarget(t["backend"], t["arch"], t["warp_size"]),
                          options=options)


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Triton's prints (a ptxas failure prints the whole PTX) into a buffer, one caller at a
    time (``sys.stdout`` is process-wide)."""
    with _QUIET, contextlib.redirect_stdout(io.StringIO()) as buf:
        yield buf


def error_text(err: BaseException, limit: int = WHY_LINES) -> str:
    """The first lines of Triton's message. A ``CompilationError`` quotes up to 12 source lines
    before its caret: only the last two are kept, so the message itself fits."""
    lines = f"{type(err).__name__}: {err}".splitlines() or [type(err).__name__]
    caret = next((i for i, line in enumerate(lines) if line.strip() == "^"), None)
    if caret is not None and caret > 3:
        lines = [lines[0], *lines[caret - 2:]]
    return "\n".join(line[:200] for line in lines[:limit])


def failure(spec: dict[str, Any], err: BaseException, keep_dir: str | Path | None,
            failed_in: str, printed: str = "") -> CompileError:
    """Save ``spec`` with ``err`` as a reproducer and return the error that names it.
    ``failed_in``: ``compile`` (``triton.compile`` raised), ``launch`` (the first launch on a
    GPU raised; compiled again here for the TTIR and to tell compile from launch) or
    ``interpreter``."""
    ttir, again, note = None, None, ""
    if failed_in == "launch" or (failed_in == "compile" and not _frontend_error(err)):
        ttir, again, printed_again = recompile(spec)
        printed = printed or printed_again
    if failed_in == "launch":
        note = ("\n(ahead of time the same launch compiles: the launch failed, not Triton's "
                "compile)" if again is None else "\n(it fails ahead of time too)")
    saved = save(document(spec, failed_in, f"{type(err).__name__}: {err}", ttir, printed),
                 keep_dir)
    reproduces = failed_in == "compile" or (failed_in == "launch" and again is not None)
    return CompileError(_what(spec, failed_in), at=spec.get("loc") or f"kernel {spec['kernel']}"
                        " (no source location)", why=_indent(error_text(err) + note),
                        next=_next(reproduces, saved))


def _frontend_error(err: BaseException) -> bool:
    """Raised while the kernel source became TTIR: there is no TTIR to save."""
    from triton.compiler.errors import CompilationError

    return isinstance(err, CompilationError)


def recompile(spec: dict[str, Any]) -> tuple[str | None, BaseException | None, str]:
    """``compile_spec`` again with Triton's IR dump on: ``(ttir, error or None, printed)``."""
    import triton

    fn = getattr(loader.kernels(False), spec["kernel"])
    with tempfile.TemporaryDirectory(prefix="qcompile-ttir-") as tmp, quiet() as buf, \
            triton.knobs.compilation.scope(), triton.knobs.cache.scope():
        triton.knobs.compilation.dump_ir = True
        triton.knobs.compilation.always_compile = True     # a cache hit would dump nothing
        triton.knobs.cache.dump_dir = tmp
        again: BaseException | None = None
        try:
            compile_spec(spec, fn)
        except Exception as err:  # noqa: BLE001 - the first failure is the one reported
            again = err
        dumped = sorted(Path(tmp).rglob("*.ttir"))
        return (dumped[0].read_text(encoding="utf-8") if dumped else None), again, buf.getvalue()


def document(spec: dict[str, Any], failed_in: str, error: str, ttir: str | None,
             printed: str) -> dict[str, Any]:
    """The reproducer of ``spec`` (:func:`.aot.launch_spec`): the table at the top."""
    import triton

    source = loader.source_text()
    return {"format": FORMAT, "version": VERSION, **spec, "failed_in": failed_in,
            "error": error, "ttir": ttir, "triton_output": printed[-200_000:], "source": source,
            "source_sha256": _sha256(source), "triton_version": triton.__version__}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def save(doc: dict[str, Any], keep_dir: str | Path | None) -> Path:
    """``doc`` as ``triton.<kernel>.sm<arch>.<hash>.failed.json`` in ``keep_dir`` (default: the
    current folder); the hash is of what ``triton.compile`` got, so one launch is one file."""
    where = Path(keep_dir if keep_dir is not None else ".")
    where.mkdir(parents=True, exist_ok=True)
    key = json.dumps([doc[k] for k in ("kernel", "signature", "constexprs", "attrs",
                                       "num_warps", "num_stages", "options", "target")],
                     sort_keys=True)
    path = where / (f"triton.{doc['kernel']}.sm{doc['target']['arch']}."
                    f"{_sha256(key)[:10]}.failed.json")
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path.resolve()          # the command works from any folder


def command(path: Path) -> str:
    return shlex.join([sys.executable, "-m", "qcompile.codegen.triton.repro", str(path)])


def _what(spec: dict[str, Any], failed_in: str) -> str:
    kernel, arch = spec["kernel"], spec["target"]["arch"]
    chain = f" (chain {spec['step']})" if spec.get("step") else ""
    return {"compile": f"triton could not compile kernel '{kernel}'{chain} for sm_{arch}",
            "launch": f"kernel '{kernel}'{chain} failed at its first launch on the GPU "
                      f"(sm_{arch}), where Triton compiles it",
            "interpreter": f"kernel '{kernel}'{chain} failed in Triton's interpreter"}[failed_in]


def _next(reproduces: bool, saved: Path) -> str:
    if reproduces:
        return f"reproduce with: {command(saved)}"
    return f"the launch is saved; compile it alone with: {command(saved)}"


def _indent(text: str) -> str:
    return text.replace("\n", "\n" + " " * 8)       # under the text after "  why:  "


# -- the command ---------------------------------------------------------------------------------

def load(path: Path) -> dict[str, Any]:
    """The reproducer at ``path``, checked: an ``ArtifactError`` says what is wrong."""
    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"cannot use the Triton reproducer {path}", at=str(path), why=why,
                             next="use the file a failed compile saved, unedited (or compile "
                                  "again to save a new one)")

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise bad(f"cannot read it: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"it is not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"it is not a qcompile Triton reproducer (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise bad(f"reproducer version {doc.get('version')!r}; this qcompile reads {VERSION}")
    for key, kind in REQUIRED.items():
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise bad(f"key {key!r} is missing or not a {kind.__name__}")
    if not _target_ok(doc["target"]) or not _attrs_ok(doc["attrs"]):
        raise bad("key 'target' needs backend (str), arch and warp_size (int); key 'attrs' "
                  "[[arg index], [[name, value], ...]] pairs")
    if _sha256(doc["source"]) != doc["source_sha256"]:
        raise bad("its kernels source does not match source_sha256 (the file was edited or "
                  "truncated)")
    return doc


def _target_ok(t: dict[str, Any]) -> bool:
    return isinstance(t.get("backend"), str) and all(
        isinstance(t.get(k), int) and not isinstance(t.get(k), bool) for k in ("arch",
                                                                                "warp_size"))


def _attrs_ok(attrs: list[Any]) -> bool:
    return all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], list)
               and isinstance(a[1], list) for a in attrs)


def kernel_of(doc: dict[str, Any], folder: Path, path: Path) -> Any:
    """The reproducer's kernel, from the kernels source it carries."""
    src = folder / "kernels.py"
    src.write_text(doc["source"], encoding="utf-8")
    name = f"qcompile_repro_kernels_{doc['source_sha256'][:12]}"
    try:
        module = loader.load_source(str(src), name, interpret=False)
    except Exception as err:  # noqa: BLE001 - whatever the carried source raises
        raise ArtifactError(f"cannot use the Triton reproducer {path}", at=str(path),
                            why=f"its kernels source does not load: {error_text(err, 4)}",
                            next="compile again to save a new reproducer") from None
    fn = getattr(module, doc["kernel"], None)
    kernels = sorted(k for k, v in vars(module).items()
                     if hasattr(v, "arg_names") and not k.startswith("_"))
    if doc["kernel"] not in kernels:
        raise ArtifactError(f"cannot use the Triton reproducer {path}", at=str(path),
                            why=f"no kernel {doc['kernel']!r} in its source; kernels: "
                                f"{', '.join(kernels)}", next="compile again")
    if list(doc["signature"]) != list(fn.arg_names):
        raise ArtifactError(f"cannot use the Triton reproducer {path}", at=str(path),
                            why=f"the signature names {list(doc['signature'])}, the kernel "
                                f"takes {list(fn.arg_names)}", next="compile again")
    return fn


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m qcompile.codegen.triton.repro FILE.json\n"
              "  reruns the triton.compile a failed qcompile compile saved in FILE.json; exit 0 "
              "when it compiles, 1 when it still fails, 2 when the file is unusable",
              file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        doc = load(path)
        with tempfile.TemporaryDirectory(prefix="qcompile-repro-") as tmp:
            fn = kernel_of(doc, Path(tmp), path)
            return _compile(doc, fn)
    except ArtifactError as err:
        print(f"qcompile: error: {err}", file=sys.stderr)
        return err.exit_code


def _compile(doc: dict[str, Any], fn: Any) -> int:
    import triton

    arch, kernel = doc["target"]["arch"], doc["kernel"]
    where = ", ".join(f"{label} {doc[k]}" for label, k in (("chain", "step"), ("at", "loc"))
                      if doc.get(k))
    print(f"compiling kernel '{kernel}'{f' ({where})' if where else ''} for sm_{arch} with "
          f"triton {triton.__version__}", flush=True)
    if doc.get("triton_version") not in (None, triton.__version__):
        print(f"note: it failed with triton {doc['triton_version']}", flush=True)
    with triton.knobs.compilation.scope():
        triton.knobs.compilation.always_compile = True     # rerun it, not a cached result
        try:
            k = compile_spec(doc, fn)
        except Exception as err:  # noqa: BLE001 - Triton's error is the answer
            print(f"qcompile: kernel '{kernel}' still fails for sm_{arch}:\n"
                  f"{type(err).__name__}: {err}", file=sys.stderr)
            return 1
    ptx = k.asm.get("ptx", "")
    print(f"ok: kernel '{kernel}' compiles for sm_{arch} ({len(ptx.splitlines())} PTX lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``.qca`` artifacts: a compiled ``cpu`` model that loads without torch.export, QIR or a recipe.

A zip (stored, not compressed) of ``meta.json`` and one IREE module per compiled batch size,
``b<N>.vmfb``. ``meta.json`` holds the format version, the target, the host it was compiled for,
the input signature, the output dtypes and shapes, and each module's size and SHA-256. Loading
checks all of it before any module reaches IREE; nothing in an artifact is executed but the IREE
modules it declares (no pickle anywhere). Writes are atomic (temp file + rename).
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import zipfile
from pathlib import Path
from typing import Any

import torch

from qcompile.errors import ArtifactError
from qcompile.report.writer import atomic_write_bytes
from qcompile.runtime.compiled import CompiledModel, InputSignature

FORMAT = "qcompile-artifact"
FORMAT_VERSION = 1
MAX_META_BYTES = 1 << 20
DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32,
          "uint8": torch.uint8, "int8": torch.int8}


def save(model: CompiledModel, path: str | Path) -> Path:
    """Write ``model`` (target ``cpu``) as a ``.qca`` artifact at ``path``."""
    from qcompile.codegen.cpu import CpuRunner

    runner = model.runner
    if model.target != "cpu" or not isinstance(runner, CpuRunner):
        raise ArtifactError(f"cannot save a {model.target!r} model as an artifact",
                            why="only target 'cpu' compiles to a self-contained module",
                            next="compile with target='cpu' first")
    blobs = {f"b{b}.vmfb": m.vmfb for b, m in sorted(runner.modules.items())}
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "target": "cpu",
        "host": host_id(), "qcompile": _version(),
        "inputs": [{"name": s.name, "dtype": str(s.dtype).removeprefix("torch."),
                    "shape": list(s.shape), "batch": s.batch, "max_batch": s.max_batch}
                   for s in model.signature],
        "outputs": [{"dtype": o.dtype, "shape": list(o.shape)} for o in runner.outputs],
        "modules": {name: {"batch": int(name[1:-5]), "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}
                    for name, data in blobs.items()},
        "flags": {str(b): list(m.flags) for b, m in runner.modules.items()},
        "report": {k: model.report[k] for k in ("passes", "residency") if k in model.report},
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("meta.json", json.dumps(meta, indent=1, allow_nan=False))
        for name, data in blobs.items():
            z.writestr(name, data)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def load(path: str | Path) -> CompiledModel:
    """Read and check a ``.qca`` artifact; every problem is an :class:`ArtifactError`."""
    from qcompile.codegen.cpu import BatchModule, CpuRunner, OutputSpec

    path = Path(path)
    meta, blobs = _read(path)
    try:
        signature = tuple(InputSignature(i["name"], DTYPES[i["dtype"]], tuple(i["shape"]),
                                         i["batch"], int(i["max_batch"]))
                          for i in meta["inputs"])
        outputs = [OutputSpec(o["dtype"], tuple(o["shape"])) for o in meta["outputs"]]
        modules = {int(m["batch"]): BatchModule(int(m["batch"]), blobs[name],
                                                tuple(meta["flags"][str(m["batch"])]), None)
                   for name, m in meta["modules"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _bad(path, f"meta.json is malformed ({type(err).__name__}: {err})") from None
    if not modules:
        raise _bad(path, "meta.json lists no modules")
    for m in modules.values():
        m.module()   # load now: a module IREE rejects fails here, not at the first call
    report = {**meta.get("report", {}), "artifact": str(path)}
    return CompiledModel("cpu", signature, CpuRunner(modules, outputs), report)


def _read(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    if not path.is_file():
        raise ArtifactError(f"artifact not found: {path}", at=str(path), why="no such file",
                            next="compile one with: qcompile compile RECIPE -o model.qca")
    try:
        with zipfile.ZipFile(path) as z:
            meta_info = z.getinfo("meta.json")
            if meta_info.file_size > MAX_META_BYTES:
                raise _bad(path, f"meta.json is {meta_info.file_size} bytes")
            meta = json.loads(z.read("meta.json"))
            _check_meta(path, meta)
            blobs = {}
            for name, m in meta["modules"].items():
                data = z.read(name)
                if len(data) != m["bytes"] or hashlib.sha256(data).hexdigest() != m["sha256"]:
                    raise _bad(path, f"{name} does not match its checksum (corrupt or edited)")
                blobs[name] = data
    except ArtifactError:
        raise
    except KeyError as err:
        raise _bad(path, f"missing member {err}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, json.JSONDecodeError, UnicodeDecodeError,
            OSError, EOFError, ValueError, TypeError, AttributeError, RuntimeError,
            NotImplementedError) as err:
        raise _bad(path, f"unreadable ({type(err).__name__}: {err})") from None
    return meta, blobs


def _check_meta(path: Path, meta: Any) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, "not a qcompile artifact (meta.json has no qcompile format tag)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact {path} has format version {meta.get('format_version')!r}",
                            at=str(path), why=f"this qcompile reads version {FORMAT_VERSION}",
                            next="recompile the model with this qcompile")
    if meta.get("target") != "cpu":
        raise ArtifactError(f"artifact {path} is for target {meta.get('target')!r}",
                            at=str(path), why="this qcompile runs artifacts of target 'cpu'",
                            next="recompile with --target cpu")
    if meta.get("host") != host_id():
        raise ArtifactError(f"artifact {path} was compiled for another machine", at=str(path),
                            why=f"compiled for {meta.get('host')!r}, this is {host_id()!r} "
                                "(the code uses the compiling CPU's instruction set)",
                            next="recompile on this machine")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("bytes"), int)
            and isinstance(v.get("sha256"), str) and isinstance(v.get("batch"), int)
            for k, v in modules.items()):
        raise _bad(path, "meta.json lists its modules wrongly")


def _bad(path: Path, why: str) -> ArtifactError:
    return ArtifactError(f"artifact {path} is corrupt", at=str(path), why=why,
                         next="recompile it (qcompile compile RECIPE -o FILE.qca)")


def host_id() -> str:
    """The host CPU IREE compiles for (``--iree-llvmcpu-target-cpu=host``)."""
    return f"{platform.machine()}:{_cpu_model()}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version() -> str:
    from qcompile import __version__

    return __version__

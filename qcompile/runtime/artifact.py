"""``.qca`` artifacts: a compiled ``cpu`` model that loads without torch.export, QIR or a recipe.

A zip (stored, not compressed) of ``meta.json`` and one IREE module per compiled batch size,
``b<N>.vmfb`` (format version 1), or, for a token model compiled at several sequence lengths, one
per length and batch size, ``s<L>.b<N>.vmfb`` (format version 2, which adds ``seq_lens`` and each
output's ``seq_dim``; version 1 artifacts still load). ``meta.json`` holds the format version,
the target, the host it was compiled for, the input signature, the output dtypes and shapes, and
each module's size and SHA-256. Loading checks all of it before any module reaches IREE: the
member list (exactly ``meta.json`` and the declared modules, stored uncompressed, of their
declared sizes), every field's type, the batch sizes (and lengths) against the input signature,
each module's checksum, and the signature IREE reads from each module's ``main`` against
``meta.json`` (parsed, not run). Nothing in an artifact is executed but the IREE modules it
declares (no pickle anywhere). The checksums detect corruption, not tampering: an artifact is not
signed. Writes are atomic (temp file + rename).
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from qcompile.errors import ArtifactError
from qcompile.report.writer import atomic_write_bytes
from qcompile.runtime.compiled import CompiledModel, InputSignature

FORMAT = "qcompile-artifact"
FORMAT_VERSION = 2           # written for several sequence lengths; else version 1
READ_VERSIONS = (1, 2)
MAX_META_BYTES = 1 << 20
MAX_MODULE_BYTES = 1 << 30
MAX_DIM = 1 << 20
DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32,
          "uint8": torch.uint8, "int8": torch.int8}
OUTPUT_DTYPES = ("f32", "i8", "u8", "i32", "i64", "bool")   # QIR dtype names
_MLIR_TYPES = {"float32": "f32", "int64": "i64", "int32": "i32", "uint8": "i8", "int8": "i8"}


def save(model: CompiledModel, path: str | Path) -> Path:
    """Write ``model`` (target ``cpu``) as a ``.qca`` artifact at ``path``."""
    from qcompile.codegen.cpu import CpuRunner
    from qcompile.runtime.seq_lens import SeqLenRunner

    runner = model.runner
    runners = runner.runners if isinstance(runner, SeqLenRunner) else {None: runner}
    if model.target != "cpu" or not all(isinstance(r, CpuRunner) for r in runners.values()):
        raise ArtifactError(f"cannot save a {model.target!r} model as an artifact",
                            why="only target 'cpu' compiles to a self-contained module",
                            next="compile with target='cpu' first")
    entries = {_key(seq, b): (seq, b, m) for seq, r in runners.items()
               for b, m in sorted(r.modules.items())}
    blobs = {f"{k}.vmfb": m.vmfb for k, (_, _, m) in entries.items()}
    last = runners[max(runners, key=lambda n: n or 0)]
    meta = {
        "format": FORMAT, "format_version": 1 if None in runners else FORMAT_VERSION,
        "target": "cpu", "host": host_id(), "qcompile": _version(),
        "inputs": [{"name": s.name, "dtype": str(s.dtype).removeprefix("torch."),
                    "shape": list(s.shape), "batch": s.batch, "max_batch": s.max_batch}
                   for s in model.signature],
        "outputs": [{"dtype": o.dtype, "shape": list(o.shape)} for o in last.outputs],
        "modules": {f"{k}.vmfb": {**({} if seq is None else {"seq": seq}), "batch": b,
                                  "bytes": len(m.vmfb),
                                  **({"pooled": True} if m.pooled else {}),
                                  **({"finite_check": True} if m.finite_check else {}),
                                  "sha256": hashlib.sha256(m.vmfb).hexdigest()}
                    for k, (seq, b, m) in entries.items()},
        "flags": {_flag_key(seq, b): list(m.flags) for seq, b, m in entries.values()},
        "report": {k: model.report[k] for k in ("passes", "residency", "seq_lens")
                   if k in model.report},
    }
    if isinstance(runner, SeqLenRunner):
        meta["seq_lens"] = runner.lengths
        meta["calibration_seq_len"] = runner.main
        for out, dim in zip(meta["outputs"], runner.seq_dims, strict=True):
            out["seq_dim"] = dim
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
    from qcompile.runtime.seq_lens import SeqLenRunner

    path = Path(path)
    meta, blobs = _read(path)
    seq_lens = tuple(meta.get("seq_lens", ()))
    try:
        signature = tuple(InputSignature(i["name"], DTYPES[i["dtype"]], tuple(i["shape"]),
                                         i["batch"], int(i["max_batch"]), seq_lens)
                          for i in meta["inputs"])
        runners: dict[int | None, CpuRunner] = {}
        for seq in seq_lens or (None,):
            outputs = [OutputSpec(o["dtype"], _at_length(o, seq)) for o in meta["outputs"]]
            modules = {int(m["batch"]): BatchModule(
                int(m["batch"]), blobs[name], tuple(meta["flags"][_flag_key(seq, m["batch"])]),
                None, pooled=bool(m.get("pooled", False)),
                finite_check=bool(m.get("pooled", False) and m.get("finite_check", False)))
                for name, m in meta["modules"].items() if m.get("seq") == seq}
            runners[seq] = CpuRunner(modules, outputs)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _bad(path, f"meta.json is malformed ({type(err).__name__}: {err})") from None
    if not any(r.modules for r in runners.values()):
        raise _bad(path, "meta.json lists no modules")
    for seq, r in runners.items():
        for m in r.modules.values():
            _check_declaration(path, seq, m.batch, m.vmfb, meta, m.pooled)
    for r in runners.values():
        for m in r.modules.values():
            m.module()   # load now: a module IREE rejects fails here, not at the first call
    report = {**meta.get("report", {}), "artifact": str(path)}
    if not seq_lens:
        return CompiledModel("cpu", signature, runners[None], report)
    dims = tuple(o["seq_dim"] for o in meta["outputs"])
    runner = SeqLenRunner({n: r for n, r in runners.items() if n is not None}, dims,
                          meta["calibration_seq_len"])
    return CompiledModel("cpu", signature, runner, report)


def _key(seq: int | None, batch: int) -> str:
    """A module's name in the zip, without ``.vmfb``."""
    return f"b{batch}" if seq is None else f"s{seq}.b{batch}"


def _flag_key(seq: int | None, batch: int) -> str:
    """A module's key in ``flags`` (version 1: the batch size alone)."""
    return str(batch) if seq is None else _key(seq, batch)


def _at_length(output: dict[str, Any], seq: int | None) -> tuple[int, ...]:
    """An output's shape (without batch) at sequence length ``seq``."""
    shape = list(output["shape"])
    if seq is not None and output["seq_dim"] is not None:
        shape[output["seq_dim"] - 1] = seq
    return tuple(shape)


def _read(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    if not path.is_file():
        raise ArtifactError(f"artifact not found: {path}", at=str(path), why="no such file",
                            next="compile one with: qcompile compile RECIPE -o model.qca")
    try:
        with zipfile.ZipFile(path) as z:
            if len(z.namelist()) != len(set(z.namelist())):
                raise _bad(path, "a member appears twice")
            _check_member(path, z.getinfo("meta.json"), MAX_META_BYTES)
            meta = json.loads(z.read("meta.json"))
            _check_meta(path, meta)
            _check_members(path, z, meta["modules"])
            blobs = {}
            for name, m in meta["modules"].items():
                _check_member(path, z.getinfo(name), MAX_MODULE_BYTES, m["bytes"])
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
    if type(meta.get("format_version")) is not int or \
            meta["format_version"] not in READ_VERSIONS:
        raise ArtifactError(f"artifact {path} has format version {meta.get('format_version')!r}",
                            at=str(path), why="this qcompile reads versions " +
                            ", ".join(map(str, READ_VERSIONS)),
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
    lengths = _check_seq_lens(path, meta)
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules or not all(
            isinstance(v, dict) and _count(v.get("batch"))
            and (v.get("seq") is None if not lengths else v.get("seq") in lengths)
            and k == f"{_key(v.get('seq'), v['batch'])}.vmfb"
            and _count(v.get("bytes"), 0) and isinstance(v.get("sha256"), str)
            for k, v in modules.items()):
        raise _bad(path, "meta.json lists its modules wrongly")
    flags = meta.get("flags")
    keys = [_flag_key(v.get("seq"), v["batch"]) for v in modules.values()]
    if not isinstance(flags, dict) or not all(
            isinstance(flags.get(k), list) and all(isinstance(f, str) for f in flags[k])
            for k in keys):
        raise _bad(path, "meta.json lists the compile flags wrongly")
    if not isinstance(meta.get("report", {}), dict):
        raise _bad(path, "meta.json's report is not a mapping")
    inputs = meta["inputs"] if _inputs_ok(meta) else None
    for seq in lengths or [None]:
        _check_signature(path, inputs, meta.get("outputs"),
                         {v["batch"] for v in modules.values() if v.get("seq") == seq})
    if lengths:
        _check_seq_shapes(path, inputs, meta["outputs"], lengths)


def _check_seq_lens(path: Path, meta: dict[str, Any]) -> list[int]:
    """Version 2: the compiled sequence lengths (ascending, the calibration length among
    them); version 1: none."""
    if meta["format_version"] == 1:
        if "seq_lens" in meta:
            raise _bad(path, "a version 1 artifact lists seq_lens")
        return []
    lengths = meta.get("seq_lens")
    if not isinstance(lengths, list) or len(lengths) < 2 or not all(
            _count(n, 1, MAX_DIM) for n in lengths) or lengths != sorted(set(lengths)) \
            or meta.get("calibration_seq_len") not in lengths:
        raise _bad(path, "meta.json lists its sequence lengths wrongly")
    return lengths


def _check_seq_shapes(path: Path, inputs: Any, outputs: list[dict[str, Any]],
                      lengths: list[int]) -> None:
    """Inputs are (N, longest length); an output's ``seq_dim`` is a dimension of that length."""
    longest = max(lengths)
    if any(len(i["shape"]) != 1 or i["shape"][0] != longest for i in inputs):
        raise _bad(path, f"the inputs are not token inputs of length {longest}")
    for o in outputs:
        dim = o.get("seq_dim", False)
        if not (dim is None or (_count(dim, 1, len(o["shape"]))
                                and o["shape"][dim - 1] == longest)):
            raise _bad(path, f"an output's seq_dim {dim!r} is no dimension of length {longest}")


def _count(v: Any, lo: int = 1, hi: int = MAX_MODULE_BYTES) -> bool:
    """An int in ``lo..hi`` (JSON true/false are not counts)."""
    return type(v) is int and lo <= v <= hi


def _dims(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= 8 and all(_count(d, 1, MAX_DIM)
                                                               for d in shape)


def _inputs_ok(meta: dict[str, Any]) -> bool:
    inputs = meta.get("inputs")
    return isinstance(inputs, list) and bool(inputs) and all(
        isinstance(i, dict) and isinstance(i.get("name"), str) and i.get("dtype") in DTYPES
        and _dims(i.get("shape")) and (i.get("batch") is None or _count(i.get("batch")))
        and _count(i.get("max_batch"), 1, MAX_DIM) for i in inputs)


def _check_signature(path: Path, inputs: list[dict[str, Any]] | None, outputs: Any,
                     batches: set[int]) -> None:
    """Input and output descriptions well formed; the modules' batch sizes those the inputs
    accept (a static batch: that one module; a dynamic one: 1 among them, none above max)."""
    if inputs is None:
        raise _bad(path, "meta.json describes its inputs wrongly")
    if not isinstance(outputs, list) or not outputs or not all(
            isinstance(o, dict) and o.get("dtype") in OUTPUT_DTYPES and _dims(o.get("shape"))
            for o in outputs):
        raise _bad(path, "meta.json describes its outputs wrongly")
    static = {i["batch"] for i in inputs}
    if None not in static and (len(static) != 1 or batches != static):
        raise _bad(path, f"modules for batch sizes {sorted(batches)} but the inputs take batch "
                         f"{sorted(static)} only")
    if None in static and (static != {None} or 1 not in batches
                           or max(batches) > min(i["max_batch"] for i in inputs)):
        raise _bad(path, f"modules for batch sizes {sorted(batches)} do not cover batches 1.."
                         f"{min(i['max_batch'] for i in inputs)} in pieces")


def _check_member(path: Path, info: zipfile.ZipInfo, limit: int, size: int | None = None
                  ) -> None:
    """Sizes from the zip directory, before a byte is read: stored (never inflated), bounded."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise _bad(path, f"{info.filename} is compressed; qcompile stores members")
    if info.file_size > limit or info.compress_size != info.file_size:
        raise _bad(path, f"{info.filename} declares {info.file_size} bytes")
    if size is not None and info.file_size != size:
        raise _bad(path, f"{info.filename} holds {info.file_size} bytes, meta.json says {size}")


def _check_members(path: Path, z: zipfile.ZipFile, modules: dict[str, Any]) -> None:
    names = z.namelist()
    if extra := sorted(set(names) - {"meta.json", *modules}):
        raise _bad(path, f"unexpected member(s) {', '.join(map(repr, extra[:5]))}")
    if missing := sorted(set(modules) - set(names)):
        raise _bad(path, f"missing member {missing[0]!r}")


_TENSOR = re.compile(r"tensor<([0-9x]*?)x?([a-z]+[0-9]*)>")


def _check_declaration(path: Path, seq: int | None, batch: int, vmfb: bytes,
                       meta: dict[str, Any], pooled: bool = False) -> None:
    """The signature IREE reads from the module's ``main`` (parsed, nothing run) against
    meta.json: a module swapped for another model's, or a meta.json edited, stops here. A
    pooled module takes the pool operand last."""
    import iree.runtime as rt

    from qcompile.codegen.iree_cpu import OUTPUT_ARG
    from qcompile.codegen.ukernel import CTX_SIZE

    name = f"{_key(seq, batch)}.vmfb"
    try:
        vm = rt.VmModule.copy_buffer(rt.VmInstance(), vmfb)
        declared = (vm.lookup_function("main") or _no_main()).reflection.get(
            "iree.abi.declaration", "")
    except (RuntimeError, ValueError, AttributeError) as err:
        raise _bad(path, f"{name} is no loadable IREE module ({str(err)[:200]})") from None
    args, _, results = declared.partition("->")
    # a pooled module may take its results' storage after the pool operand (iree.abi.output)
    storage = [_TENSOR.findall(t)[0] for t, _ in sorted(OUTPUT_ARG.findall(args),
                                                         key=lambda a: int(a[1]))]
    args = OUTPUT_ARG.sub("", args)
    want_in = [(f"{batch}x" + "x".join(map(str, _in_shape(i, seq)))).rstrip("x") + " " +
               _MLIR_TYPES[i["dtype"]] for i in meta["inputs"]]
    want_in += [f"{CTX_SIZE} i64"] if pooled else []
    got_in = [f"{dims} {t}" for dims, t in _TENSOR.findall(args)]
    want_out = [(f"{batch}x" + "x".join(map(str, _at_length(o, seq)))).rstrip("x")
                for o in meta["outputs"]]
    got_out = [dims for dims, _ in _TENSOR.findall(results)]
    if storage and (not pooled or [d for d, _ in storage] != got_out):
        got_in += [f"{dims} {t} (storage)" for dims, t in storage]
    if got_in != want_in or got_out != want_out:
        raise _bad(path, f"{name} takes {got_in} -> {got_out}; meta.json says "
                         f"{want_in} -> {want_out}")


def _in_shape(i: dict[str, Any], seq: int | None) -> list[int]:
    return list(i["shape"]) if seq is None else [seq, *i["shape"][1:]]


def _no_main() -> Any:
    raise ValueError("the module has no function 'main'")


def _bad(path: Path, why: str) -> ArtifactError:
    return ArtifactError(f"artifact {path} is corrupt", at=str(path), why=why,
                         next="recompile it (qcompile compile RECIPE -o FILE.qca)")


def host_id() -> str:
    """The host CPU IREE compiles for (``--iree-llvmcpu-target-cpu=host``)."""
    return f"{platform.machine()}:{cpu_model()}"


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
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

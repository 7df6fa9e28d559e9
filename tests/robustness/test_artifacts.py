"""Damaged ``.qca`` artifacts are refused with an ``ArtifactError`` before any IREE module is
instantiated (so before any of its code runs); saving is atomic; qcompile never unpickles."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import robustness_tally as tally
import torch
from hypothesis import given
from hypothesis import strategies as st

import qcompile
from qcompile.codegen import iree_cpu
from qcompile.errors import ArtifactError

ROOT = Path(__file__).parents[2]
Members = dict[str, bytes]


@pytest.fixture
def instantiated(monkeypatch) -> list[int]:
    """Records every IREE module instantiation (context creation runs module code)."""
    made: list[int] = []
    real = iree_cpu.Module.__init__

    def spy(self, vmfb, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(len(vmfb))
        real(self, vmfb, *args, **kwargs)

    monkeypatch.setattr(iree_cpu.Module, "__init__", spy)
    return made


def refused(path: Path, case_id: str, made: list[int], match: str | None = None
            ) -> ArtifactError:
    try:
        with pytest.raises(ArtifactError, match=match) as err:
            qcompile.load(path)
    except BaseException as unexpected:
        tally.record_unexpected(unexpected, f"artifact {case_id}")
        raise
    assert made == [], f"{case_id}: an IREE module was instantiated before the refusal"
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) <= 5
    tally.case("corrupted-artifact cases", case_id)
    return err.value


# ------------------------------------------------------------------------- damaged bytes
def _layout(path: Path) -> dict[str, int]:
    """Byte offsets of the zip's regions."""
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
        cd = z.start_dir  # type: ignore[attr-defined]
    meta, b1, b2 = infos["meta.json"], infos["b1.vmfb"], infos["b2.vmfb"]

    def data(i: zipfile.ZipInfo) -> int:
        return i.header_offset + 30 + len(i.filename) + len(i.extra)

    size = path.stat().st_size
    return {"meta_header": meta.header_offset, "meta_data": data(meta),
            "meta_end": data(meta) + meta.file_size, "b1_header": b1.header_offset,
            "b1_data": data(b1), "b1_mid": data(b1) + b1.file_size // 2,
            "b2_header": b2.header_offset, "b2_end": data(b2) + b2.file_size - 1, "cd": cd,
            "eocd": size - 22, "size": size}


TRUNCATIONS = {
    "empty": lambda o: 0, "first-10-bytes": lambda o: 10, "inside-meta-header": lambda o: 20,
    "inside-meta-json": lambda o: o["meta_data"] + 40, "after-meta-json": lambda o: o["meta_end"],
    "inside-first-module": lambda o: o["b1_mid"], "before-second-module": lambda o: o["b2_header"],
    "before-central-directory": lambda o: o["cd"], "inside-central-directory":
        lambda o: o["cd"] + 50, "before-end-record": lambda o: o["eocd"],
    "last-byte-missing": lambda o: o["size"] - 1,
}


@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated__refused(artifact, tmp_path, instantiated, where):
    bad = tmp_path / "cut.qca"
    bad.write_bytes(artifact.read_bytes()[:TRUNCATIONS[where](_layout(artifact))])
    refused(bad, f"truncated {where}", instantiated, "corrupt")


# (region, offset in the file): every field a flip there must be caught by
FLIPS = {
    "meta-header-signature": lambda o: o["meta_header"],
    "meta-header-name-length": lambda o: o["meta_header"] + 26,
    "meta-header-name": lambda o: o["meta_header"] + 31,
    "meta-json-first-byte": lambda o: o["meta_data"],
    "meta-json-middle": lambda o: o["meta_data"] + 100,
    "module-header-signature": lambda o: o["b1_header"],
    "module-header-name": lambda o: o["b1_header"] + 31,
    "module-data-start": lambda o: o["b1_data"],
    "module-data-middle": lambda o: o["b1_mid"],
    "module-data-last-byte": lambda o: o["b2_end"],
    "central-directory-signature": lambda o: o["cd"],
    "central-directory-crc": lambda o: o["cd"] + 16,
    "central-directory-size": lambda o: o["cd"] + 24,
    "central-directory-name": lambda o: o["cd"] + 46,
    "central-directory-header-offset": lambda o: o["cd"] + 44,
    "end-record-signature": lambda o: o["eocd"],
    "end-record-directory-offset": lambda o: o["eocd"] + 18,
}


@pytest.mark.parametrize("region", FLIPS)
def test_bit_flip_in_every_region__refused(artifact, tmp_path, instantiated, region):
    data = bytearray(artifact.read_bytes())
    data[FLIPS[region](_layout(artifact))] ^= 0x10
    bad = tmp_path / "flip.qca"
    bad.write_bytes(bytes(data))
    refused(bad, f"bit flip {region}", instantiated)


@tally.fuzz_settings()
@given(position=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_bit_flip__refused_or_harmless(artifact, compiled, sample, tmp_path_factory,
                                           position, bit):
    """A flip the checks let through (a timestamp, a count zipfile ignores) changes nothing."""
    tally.example("artifact: random bit flips")
    data = bytearray(artifact.read_bytes())
    data[position % len(data)] ^= 1 << bit
    bad = tmp_path_factory.mktemp("flip", numbered=True) / "flip.qca"
    bad.write_bytes(bytes(data))
    try:
        model = qcompile.load(bad)
    except ArtifactError:
        return
    except BaseException as unexpected:
        tally.record_unexpected(unexpected, f"bit flip at {position % len(data)}")
        raise
    assert torch.equal(model(sample), compiled(sample))


# ------------------------------------------------------------------- consistent zips, bad content
def _members(path: Path) -> Members:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _write_zip(dst: Path, members: list[tuple[str, bytes]] | Members,
               compress: dict[str, int] | None = None) -> Path:
    items = members.items() if isinstance(members, dict) else members
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # duplicate names on purpose
        with zipfile.ZipFile(dst, "w") as z:
            for name, data in items:
                z.writestr(name, data, compress_type=(compress or {}).get(name,
                                                                          zipfile.ZIP_STORED))
    return dst


def meta_of(m: Members) -> dict[str, Any]:
    return json.loads(m["meta.json"])


def with_meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Members], Members]:
    def apply(m: Members) -> Members:
        meta = meta_of(m)
        edit(meta)
        return {**m, "meta.json": json.dumps(meta).encode()}
    return apply


def _set(*path: str | int, value: Any) -> Callable[[Members], Members]:
    """Set (or delete, with ``_DELETE``) ``meta[path...]``."""
    def edit(meta: dict[str, Any]) -> None:
        node: Any = meta
        for p in path[:-1]:
            node = node[p]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return with_meta(edit)


_DELETE = object()


def _resign(m: Members, name: str, data: bytes) -> Members:
    """Replace a module and fix its size and checksum in meta.json (a consistent edit)."""
    meta = meta_of(m)
    meta["modules"][name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    return {**m, name: data, "meta.json": json.dumps(meta).encode()}


def _edit_module(m: Members) -> Members:
    data = bytearray(m["b1.vmfb"])
    data[len(data) // 3] ^= 0x01
    return {**m, "b1.vmfb": bytes(data)}


def _swap_modules(m: Members) -> Members:
    """b2's module under b1's name, size and checksum fixed: only the signature tells."""
    return _resign(m, "b1.vmfb", m["b2.vmfb"])


CONTENT: dict[str, tuple[Callable[[Members], Members], str]] = {
    "meta-missing": (lambda m: {k: v for k, v in m.items() if k != "meta.json"},
                     "missing member"),
    "meta-not-json": (lambda m: {**m, "meta.json": b"{not json"}, "unreadable"),
    "meta-not-utf8": (lambda m: {**m, "meta.json": b"\xff\xfe{}"}, "unreadable"),
    "meta-a-list": (lambda m: {**m, "meta.json": b"[1, 2]"}, "not a qcompile artifact"),
    "meta-empty-object": (lambda m: {**m, "meta.json": b"{}"}, "not a qcompile artifact"),
    "meta-deeply-nested": (lambda m: {**m, "meta.json": b"[" * 100_000 + b"]" * 100_000},
                           "corrupt"),
    "meta-over-1MiB": (_set("padding", value="x" * (1 << 20)), "declares"),
    "format-tag-other": (_set("format", value="zip"), "not a qcompile artifact"),
    "format-version-99": (_set("format_version", value=99), "format version 99"),
    "format-version-string": (_set("format_version", value="1"), "format version '1'"),
    "format-version-true": (_set("format_version", value=True), "format version True"),
    "format-version-missing": (_set("format_version", value=_DELETE), "format version"),
    "target-cuda": (_set("target", value="cuda"), "for target 'cuda'"),
    "host-other-machine": (_set("host", value="aarch64:Neoverse-V2"),
                           "compiled for another machine"),
    "modules-missing": (_set("modules", value=_DELETE), "lists its modules wrongly"),
    "modules-empty": (_set("modules", value={}), "lists its modules wrongly"),
    "modules-a-list": (_set("modules", value=["b1.vmfb"]), "lists its modules wrongly"),
    "module-bytes-a-string": (_set("modules", "b1.vmfb", "bytes", value="48235"),
                              "lists its modules wrongly"),
    "module-declares-a-terabyte": (_set("modules", "b1.vmfb", "bytes", value=10**12),
                                   "lists its modules wrongly"),
    "module-batch-not-its-name": (_set("modules", "b1.vmfb", "batch", value=2),
                                  "lists its modules wrongly"),
    "module-checksum-edited": (_set("modules", "b1.vmfb", "sha256", value="0" * 64),
                               "does not match its checksum"),
    "module-content-edited": (_edit_module, "does not match its checksum"),
    "module-member-missing": (lambda m: {k: v for k, v in m.items() if k != "b2.vmfb"},
                              "missing member 'b2.vmfb'"),
    "modules-swapped": (_swap_modules, "b1.vmfb takes"),
    "module-not-iree": (lambda m: _resign(m, "b1.vmfb", b"\x00" * 4096), "no loadable IREE"),
    "module-empty": (lambda m: _resign(m, "b1.vmfb", b""), "no loadable IREE"),
    "extra-member-pickle": (lambda m: {**m, "weights.pkl": b"\x80\x04N."}, "unexpected member"),
    "extra-member-path-traversal": (lambda m: {**m, "../../evil.sh": b"rm -rf /"},
                                    "unexpected member"),
    "inputs-missing": (_set("inputs", value=_DELETE), "describes its inputs wrongly"),
    "input-dtype-float64": (_set("inputs", 0, "dtype", value="float64"),
                            "describes its inputs wrongly"),
    "input-shape-negative": (_set("inputs", 0, "shape", value=[3, -8, 8]),
                             "describes its inputs wrongly"),
    "input-shape-strings": (_set("inputs", 0, "shape", value=["3", "8", "8"]),
                            "describes its inputs wrongly"),
    "input-shape-edited": (_set("inputs", 0, "shape", value=[3, 8, 9]), "b1.vmfb takes"),
    "input-rank-edited": (_set("inputs", 0, "shape", value=[3, 64]), "b1.vmfb takes"),
    "input-max-batch-zero": (_set("inputs", 0, "max_batch", value=0),
                             "describes its inputs wrongly"),
    "input-max-batch-nan": (lambda m: {**m, "meta.json": m["meta.json"].replace(
        b'"max_batch": 64', b'"max_batch": NaN')}, "describes its inputs wrongly"),
    "max-batch-below-modules": (_set("inputs", 0, "max_batch", value=1), "do not cover"),
    "static-batch-not-compiled": (_set("inputs", 0, "batch", value=4),
                                  "the inputs take batch"),
    "outputs-missing": (_set("outputs", value=_DELETE), "describes its outputs wrongly"),
    "output-dtype-unknown": (_set("outputs", 0, "dtype", value="f16"),
                             "describes its outputs wrongly"),
    "output-shape-edited": (_set("outputs", 0, "shape", value=[6]), "b1.vmfb takes"),
    "flags-missing": (_set("flags", value=_DELETE), "compile flags wrongly"),
    "report-a-list": (_set("report", value=[]), "report is not a mapping"),
}


@pytest.mark.parametrize("case_id", CONTENT)
def test_consistent_zip_with_bad_content__refused(artifact, tmp_path, instantiated, case_id):
    edit, match = CONTENT[case_id]
    bad = _write_zip(tmp_path / "bad.qca", edit(_members(artifact)))
    refused(bad, case_id, instantiated, match)


def test_duplicate_member__refused(artifact, tmp_path, instantiated):
    m = _members(artifact)
    items = [*m.items(), ("meta.json", json.dumps({**meta_of(m), "target": "cuda"}).encode())]
    refused(_write_zip(tmp_path / "dup.qca", items), "duplicate-member", instantiated,
            "appears twice")


def test_compressed_members__refused(artifact, tmp_path, instantiated):
    """qcompile stores members: a deflated one (a zip bomb's tool) is refused unread."""
    m = _members(artifact)
    for name in ("meta.json", "b1.vmfb"):
        bad = _write_zip(tmp_path / f"z-{name}.qca", m, {name: zipfile.ZIP_DEFLATED})
        refused(bad, f"compressed {name}", instantiated, "is compressed")


def test_huge_declared_size__refused_before_reading(artifact, tmp_path, instantiated,
                                                    monkeypatch):
    """The zip directory claims a 4 GiB module: refused from the directory, nothing read."""
    data = bytearray(artifact.read_bytes())
    cd = _layout(artifact)["cd"]
    with zipfile.ZipFile(artifact) as z:
        entry = cd + sum(46 + len(i.filename) + len(i.extra) + len(i.comment)
                         for i in z.infolist()[:1])       # b1.vmfb's directory entry
    struct.pack_into("<II", data, entry + 20, 0xFFFF_FFF0, 0xFFFF_FFF0)   # sizes
    bad = tmp_path / "huge.qca"
    bad.write_bytes(bytes(data))
    reads: list[str] = []
    real = zipfile.ZipFile.read
    monkeypatch.setattr(zipfile.ZipFile, "read",
                        lambda self, name, pwd=None: reads.append(str(name)) or real(self, name,
                                                                                     pwd))
    refused(bad, "huge-declared-size", instantiated, "declares")
    assert "b1.vmfb" not in reads


@pytest.mark.parametrize("case_id, make", [
    ("not-a-zip", lambda p: p.write_text("version: 1\n")),
    ("random-bytes", lambda p: p.write_bytes(os.urandom(4096))),
    ("empty-zip", lambda p: _write_zip(p, {})),
    ("a-directory", lambda p: p.mkdir()),
    ("no-such-file", lambda p: None),
])
def test_not_an_artifact__refused(tmp_path, instantiated, case_id, make):
    path = tmp_path / "x.qca"
    make(path)
    refused(path, case_id, instantiated)


def test_sound_artifact__still_loads_and_matches(artifact, compiled, sample, instantiated):
    loaded = qcompile.load(artifact)
    assert len(instantiated) == 2                     # the spy sees real loads
    assert torch.equal(loaded(sample), compiled(sample))


# ------------------------------------------------------------------------------ atomic writes
def test_interrupted_save__keeps_the_old_artifact_and_no_temp_file(artifact, compiled, tmp_path,
                                                                   monkeypatch, sample):
    target = tmp_path / "model.qca"
    target.write_bytes(artifact.read_bytes())
    before = target.read_bytes()

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt   # Ctrl-C after the bytes went out, before the rename

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compiled.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.qca"]
    assert torch.equal(qcompile.load(target)(sample), compiled(sample))


def test_save_replaces_atomically(compiled, tmp_path, monkeypatch):
    """The bytes go to a temp file in the same folder, then one rename."""
    target = tmp_path / "model.qca"
    renames: list[tuple[str, str]] = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((str(a), str(b))) or
                        real(a, b))
    compiled.save(target)
    assert len(renames) == 1 and renames[0][1] == str(target)
    assert Path(renames[0][0]).parent == tmp_path and Path(renames[0][0]).name.startswith(".")


# ---------------------------------------------------------------------------------- no pickle
SOURCES = sorted([*(ROOT / "qcompile").rglob("*.py"), *(ROOT / "calibration").rglob("*.py")])
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve",
                  "_pickle"}


def _kw(call: ast.Call, name: str) -> Any:
    for k in call.keywords:
        if k.arg == name:
            return k.value.value if isinstance(k.value, ast.Constant) else "<expr>"
    return None


def unsafe_uses(tree: ast.AST) -> list[str]:
    """Unpickling, eval/exec, torch.load without weights_only=True, np.load without
    allow_pickle=False, and YAML loading other than the safe loader."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import | ast.ImportFrom):
            names = [a.name for a in n.names] + ([n.module] if isinstance(n, ast.ImportFrom)
                                                 and n.module else [])
            found += [f"import {x}" for x in names if x.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(n, ast.Attribute) and ast.unparse(n).startswith("yaml.") and \
                n.attr.endswith("Loader") and n.attr not in ("SafeLoader", "CSafeLoader"):
            found.append(ast.unparse(n))
        elif isinstance(n, ast.Call):
            found += _unsafe_call(ast.unparse(n.func), n)
    return found


def _unsafe_call(name: str, call: ast.Call) -> list[str]:
    if name in ("eval", "exec", "torch.jit.load", "yaml.load", "yaml.unsafe_load",
                "yaml.full_load", "yaml.load_all"):
        return [name]
    if name == "torch.load" and _kw(call, "weights_only") is not True:
        return ["torch.load without weights_only=True"]
    if name in ("np.load", "numpy.load") and _kw(call, "allow_pickle") is not False:
        return [f"{name} without allow_pickle=False"]
    return []


def test_no_pickle_eval_or_unsafe_loader_anywhere_in_qcompile():
    assert len(SOURCES) > 50
    problems = {str(p.relative_to(ROOT)): unsafe_uses(ast.parse(p.read_text(encoding="utf-8")))
                for p in SOURCES}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_scan_sees_what_it_looks_for():
    bad = ("import pickle\nfrom joblib import load\ntorch.load(f)\ntorch.load(f, "
           "weights_only=False)\nnp.load(p)\nyaml.load(s)\neval('1')\nyaml.FullLoader\n")
    assert len(unsafe_uses(ast.parse(bad))) == 8
    ok = "torch.load(f, weights_only=True)\nnp.load(p, allow_pickle=False)\nyaml.safe_load(s)\n"
    assert unsafe_uses(ast.parse(ok)) == []

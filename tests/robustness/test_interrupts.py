"""Interrupting ``qcompile compile`` and ``qcompile run`` (SIGINT to the process group, as Ctrl-C
does; SIGTERM to the process, as ``kill`` and CI runners do) in the middle of compilation or of
writing the output leaves the output absent or complete, and no temp file behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import robustness_tally as tally
from robustness_models import block_recipe

import qcompile
from qcompile.report.writer import atomic_write_many, write_report

HERE = Path(__file__).parent
# each CLI child starts with SIGINT's default action, as a terminal's foreground job does (a
# shell that starts the test run in the background leaves SIGINT ignored, and an ignored signal
# stays ignored across exec: Python would then install no KeyboardInterrupt handler)
PRELUDE = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
CLI = """
import sys
from qcompile.cli import main
sys.argv = ["qcompile", *sys.argv[1:]]
main()
"""
# runs the CLI with a SIGTERM sent to itself right after the first temp file is written: the
# signal lands inside the write window
SIGNAL_MID_WRITE = """
import os, signal, sys
import qcompile.report.writer as w
real = w._write_temp
def hooked(path, data):
    tmp = real(path, data)
    os.kill(os.getpid(), signal.SIGTERM)
    return tmp
w._write_temp = hooked
from qcompile.cli import main
sys.argv = ["qcompile", *sys.argv[1:]]
main()
"""


def _descendants(pid: int) -> dict[int, str]:
    parents: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        parents[int(stat.parent.name)] = (int(text[text.rindex(")") + 2:].split()[1]), comm)
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, (ppid, comm) in parents.items():
            if ppid == p and child not in found:
                found[child] = comm
                frontier.append(child)
    return found


class Run:
    """One CLI subprocess with its own TMPDIR, interrupted by ``signal_at``."""

    def __init__(self, folder: Path, args: list[str], *, code: str | None = None) -> None:
        self.tmpdir = folder / "tmp"
        self.tmpdir.mkdir()
        env = {**os.environ, "TMPDIR": str(self.tmpdir),
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-c", PRELUDE + (code or CLI), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, cwd=folder, start_new_session=True, text=True)
        self.seen: dict[int, str] = {}

    def wait_for_iree_compile(self, timeout: float = 240) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            kids = _descendants(self.proc.pid)
            self.seen.update(kids)
            if "iree-compile" in kids.values():
                return True
            time.sleep(0.05)
        return False

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def orphans(self) -> list[str]:
        """iree-compile children still there after their parent died, running or as unreaped
        zombies (which a container's PID 1 may never reap); the running ones are killed here."""
        left = []
        for pid, comm in self.seen.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat[stat.index("(") + 1:stat.rindex(")")] != comm or comm != "iree-compile":
                continue
            state = stat[stat.rindex(")") + 2:].split()[0]
            left.append(f"{pid} (state {state})")
            if state != "Z":
                os.kill(pid, signal.SIGKILL)
        return left


def _no_temp_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.name.startswith(".") or
            p.name.endswith(".tmp")] if folder.exists() else []


def _recipe(folder: Path, batches: str = "[1, 2, 4, 8]") -> Path:
    path = folder / "block.yaml"
    path.write_text(block_recipe(f"compile: {{batch_sizes: {batches}}}\n"), encoding="utf-8")
    return path


def _absent_or_complete(out: Path) -> None:
    if out.exists():
        qcompile.load(out)                         # complete: loads and checks out
    assert _no_temp_files(out.parent) == []


def _ours(tmpdir: Path) -> list[str]:
    """What qcompile left in TMPDIR (torch's inductor cache is a cache, kept on purpose)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor"))


def _drive(run: Run, sig: signal.Signals | None, group: bool) -> dict:
    """Signal ``run`` once an iree-compile child runs (``sig`` None: it signals itself)."""
    if sig is not None:
        assert run.wait_for_iree_compile(), run.finish()
        (os.killpg if group else os.kill)(run.proc.pid, sig)
    code, output = run.finish(timeout=300)
    time.sleep(0.5)
    return {"code": code, "output": output, "orphans": run.orphans(), "tmp": _ours(run.tmpdir)}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Five CLI runs side by side (each imports torch: seconds), each interrupted its way."""
    plans = {   # name: (command, signal, to the process group, SIGTERM mid-write)
        "compile-sigint": ("compile", signal.SIGINT, True, False),
        "compile-sigterm": ("compile", signal.SIGTERM, False, False),
        "run-sigint": ("run", signal.SIGINT, True, False),
        "compile-sigterm-mid-write": ("compile", None, False, True),
        "run-sigterm-mid-write": ("run", None, False, True),
    }
    runs, outs = {}, {}
    for name, (command, _, _, mid_write) in plans.items():
        folder = tmp_path_factory.mktemp(name)
        recipe = _recipe(folder, "[1]" if mid_write else "[1, 2, 4, 8]")
        if command == "compile":
            outs[name] = folder / "out" / "block.qca"
            args = ["compile", str(recipe), "-o", str(outs[name]), "-q"]
        else:
            outs[name] = folder / "out"
            target = "reference" if mid_write else "cpu"
            args = ["run", str(recipe), "--target", target, "--out", str(outs[name]), "-q"]
        runs[name] = Run(folder, args, code=SIGNAL_MID_WRITE if mid_write else None)
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {n: pool.submit(_drive, r, plans[n][1], plans[n][2]) for n, r in runs.items()}
        return {n: {**f.result(), "out": outs[n]} for n, f in futures.items()}


@pytest.mark.parametrize("name", ["compile-sigint", "compile-sigterm"])
def test_interrupted_compile__artifact_absent_or_complete(interrupted, name):
    r = interrupted[name]
    assert r["code"] != 0, r["output"]
    _absent_or_complete(r["out"])
    assert "Traceback" not in r["output"], r["output"]
    tally.case("interrupt cases", name)


def test_sigint_compile__iree_compile_stopped_and_temp_dirs_removed(interrupted):
    r = interrupted["compile-sigint"]
    assert r["orphans"] == [] and r["tmp"] == []


def test_sigterm_compile__iree_compile_stopped_and_temp_dirs_removed(interrupted):
    r = interrupted["compile-sigterm"]
    assert r["orphans"] == [] and r["tmp"] == []


def test_sigint_during_run__report_folder_untouched(interrupted):
    r = interrupted["run-sigint"]
    assert r["code"] != 0 and "Traceback" not in r["output"], r["output"]
    assert not r["out"].exists() or not any(r["out"].iterdir())
    assert r["orphans"] == [] and r["tmp"] == []
    tally.case("interrupt cases", "run-sigint")


def test_sigterm_mid_write__artifact_complete(interrupted):
    """The signal lands between writing the temp file and the rename: held, then delivered."""
    r = interrupted["compile-sigterm-mid-write"]
    assert r["code"] == -signal.SIGTERM, r["output"]
    assert r["out"].exists(), r["output"]
    _absent_or_complete(r["out"])
    tally.case("interrupt cases", "compile-sigterm-mid-write")


def test_sigterm_mid_write__run_report_pair_complete(interrupted):
    r = interrupted["run-sigterm-mid-write"]
    out = r["out"]
    assert r["code"] == -signal.SIGTERM, r["output"]
    report = json.loads((out / "report.json").read_text())
    assert report["targets"]["reference"]["status"] == "ok"
    assert (out / "report.md").read_text().startswith("# qcompile report: block")
    assert _no_temp_files(out) == []
    tally.case("interrupt cases", "run-sigterm-mid-write")


# ------------------------------------------------------------------ the writer, in process
def _interrupt_after_first_temp(monkeypatch, sig: signal.Signals) -> None:
    import qcompile.report.writer as writer

    real = writer._write_temp
    calls: list[Path] = []

    def hooked(path: Path, data: bytes) -> Path:
        tmp = real(path, data)
        calls.append(tmp)
        if len(calls) == 1:
            os.kill(os.getpid(), sig)      # held until the renames are done
        return tmp

    monkeypatch.setattr(writer, "_write_temp", hooked)


class Stop(Exception):
    pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_report_write__both_files_new_then_the_signal(tmp_path, monkeypatch, sig):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    (out / "report.md").write_text("old")

    def stop(*_: object) -> None:
        raise Stop

    previous = signal.signal(sig, stop)
    try:
        _interrupt_after_first_temp(monkeypatch, sig)
        with pytest.raises(Stop):
            write_report(_report(), out)
    finally:
        signal.signal(sig, previous)
    assert json.loads((out / "report.json").read_text())["recipe"]["name"] == "x"
    assert (out / "report.md").read_text().startswith("# qcompile report: x")
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def test_failed_write__old_files_kept_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old a")

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_many({out / "a": b"new a", out / "b": b"new b"})
    assert (out / "a").read_text() == "old a" and sorted(os.listdir(out)) == ["a"]


def test_written_files_have_umask_permissions(tmp_path):
    """Not mkstemp's 0600: a report or artifact is as readable as any file the user writes."""
    mask = os.umask(0o022)
    try:
        atomic_write_many({tmp_path / "r.json": b"{}"})
    finally:
        os.umask(mask)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def _report() -> dict:
    return {"recipe": {"name": "x", "path": "x.yaml", "version": 1},
            "model": {"name": "m", "task": "t", "parameters": 1, "input_shapes": [[1]],
                      "dynamic_batch": False},
            "target": "reference", "versions": {}, "quantization": {
                "quantizer": "x86", "weights": "w", "activations": "a", "quantized_ops": 1,
                "calibration": {}}, "evaluation": {}, "accuracy": {"passed": True, "checks": []},
            "targets": {}, "timings_s": {}}

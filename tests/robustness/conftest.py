"""Robustness suite: prints what it exercised at the end of a run, one line per category.

When the whole package ran (every test file collected, nothing but ``slow`` tests deselected), a
count below its minimum (≥ 200 hypothesis examples per property, ≥ 20 corrupted artifacts,
≥ 20 bad recipes, ≥ 10 run-time input cases) or any unexpected exception type fails the session.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import robustness_tally as tally
import torch
from robustness_models import block_inputs, quantized_block

HERE = Path(__file__).parent
_seen_files: set[str] = set()
_deselected: list[str] = []


@pytest.fixture(scope="session")
def quantized():  # type: ignore[no-untyped-def]
    """The tiny PT2E block model (quantized once per session)."""
    return quantized_block()


@pytest.fixture(scope="session")
def compiled(quantized):  # type: ignore[no-untyped-def]
    """The block compiled for cpu at batch sizes 1 and 2 (other batches run in pieces)."""
    import qcompile

    return qcompile.compile(quantized, "cpu", {"batch_sizes": (1, 2), "analyze": False})


@pytest.fixture(scope="session")
def artifact(compiled, tmp_path_factory) -> Path:
    """``compiled`` saved as a ``.qca``; tests copy it before damaging it."""
    return compiled.save(tmp_path_factory.mktemp("artifact") / "block.qca")


@pytest.fixture(scope="session")
def sample() -> torch.Tensor:
    return block_inputs(5, seed=7)


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).parent == HERE


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(i.nodeid for i in items if _ours(i) and not i.get_closest_marker("slow"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and hasattr(report, "wasxfail") and \
            Path(report.location[0]).parent.name == HERE.name:
        tally.case("known gaps (strict xfail)", report.nodeid.split("::")[-1])


def pytest_collection_finish(session: pytest.Session) -> None:
    _seen_files.update(Path(str(i.fspath)).name for i in session.items if _ours(i))


def _full_run() -> bool:
    files = {p.name for p in HERE.glob("test_*.py")}
    return bool(files) and files <= _seen_files and not _deselected


def _lines() -> tuple[list[str], bool]:
    lines, short = [], False
    for prop, n in sorted(tally.examples.items()):
        ok = n >= tally.MIN_EXAMPLES
        short |= not ok
        lines.append(f"hypothesis examples  {prop}: {n}{'' if ok else ' (below 200)'}")
    for category, minimum in tally.MINIMUMS.items():
        n = len(tally.cases.get(category, ()))
        short |= n < minimum
        lines.append(f"{category}: {n} (minimum {minimum})")
    for category in sorted(set(tally.cases) - set(tally.MINIMUMS)):
        lines.append(f"{category}: {len(tally.cases[category])}")
    lines += [f"{what}: {n}" for what, n in sorted(tally.totals.items())]
    lines.append(f"unexpected exception types: {len(tally.unexpected)}")
    lines += [f"  {u}" for u in tally.unexpected[:20]]
    return lines, short or bool(tally.unexpected)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    if not (tally.examples or tally.cases or tally.unexpected or tally.totals):
        return
    lines, bad = _lines()
    terminalreporter.section("qcompile robustness counts")
    for line in lines:
        terminalreporter.write_line(line)
    if bad and _full_run():
        terminalreporter.write_line("FAILED: a count is below its minimum or an exception type "
                                    "was unexpected")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _full_run() and (tally.examples or tally.cases) and _lines()[1] and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

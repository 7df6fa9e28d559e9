"""Every error qcompile raises on purpose is a :class:`QCompileError`.

Messages follow one shape: what went wrong on the first line, then ``at:`` (where), ``why:`` and
``next:`` (what to do) lines. The CLI prints the message alone, without a traceback, and exits 2.
"""

from __future__ import annotations


class QCompileError(Exception):
    """Base class of all user-facing qcompile errors."""

    exit_code = 2

    def __init__(self, what: str, *, at: str | None = None, why: str | None = None,
                 next: str | None = None) -> None:
        lines = [what]
        for label, text in (("at", at), ("why", why), ("next", next)):
            if text:
                lines.append(f"  {label + ':':5} {text}")
        super().__init__("\n".join(lines))
        self.what, self.at, self.why, self.next = what, at, why, next


class RecipeError(QCompileError):
    """A recipe file is missing, unreadable or does not match the schema."""


class ModelError(QCompileError):
    """A model cannot be found, built or exported."""


class DatasetError(QCompileError):
    """A calibration/evaluation dataset cannot be read or does not fit the model."""


class QuantizationError(QCompileError):
    """PT2E quantization failed or quantized nothing."""


class UnsupportedGraphError(QCompileError):
    """The graph holds something the compiler cannot lower under the recipe's policy."""


class TargetUnavailableError(QCompileError):
    """A target was asked for that cannot run here (no GPU, not built, missing extra)."""


class CompileError(QCompileError):
    """A backend compiler failed; the message names the saved IR and the reproduce command."""


class ArtifactError(QCompileError):
    """A compiled artifact is corrupt, of another version or for another target."""


class InputError(QCompileError):
    """Run-time inputs do not match what the compiled model accepts."""


class NonFiniteInput(InputError):
    """A compiled module's input quantize saw a NaN or an infinity (the caller names where)."""

    def __init__(self) -> None:
        super().__init__("an input holds a NaN or an infinity", at="the compiled module's input",
                         why="int8 models take finite inputs only",
                         next="replace the non-finite values before the call")


class ConfigError(QCompileError):
    """An environment setting qcompile reads (``QCOMPILE_THREADS``, ...) is malformed."""


class AccuracyError(QCompileError):
    """An accuracy threshold failed (raised by ``check``; exit code 1)."""

    exit_code = 1

"""Dataset readers by name: ``get_reader("sample_photos")``, ``get_reader("npz", path="data/")``.

A reader's options are the keyword-only arguments of its constructor; an unknown name or option is
answered with the list of valid ones.
"""

from __future__ import annotations

import inspect
from typing import Any

from calibration.protocol import DatasetReader
from calibration.readers.digits import DigitsReader
from calibration.readers.npz import NpzReader
from calibration.readers.random_inputs import RandomReader
from calibration.readers.sample_photos import SamplePhotosReader
from calibration.readers.sentences import SentencesReader
from calibration.readers.word_similarity import WordSimilarityReader
from qcompile.errors import DatasetError

READERS: dict[str, type] = {
    cls.name: cls
    for cls in (RandomReader, DigitsReader, SamplePhotosReader, SentencesReader, NpzReader,
                WordSimilarityReader)
}


def reader_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_reader`, sorted."""
    return tuple(sorted(READERS))


def reader_options(name: str) -> dict[str, Any]:
    """``{option: default}`` of reader ``name`` (``inspect.Parameter.empty`` when required)."""
    params = inspect.signature(_reader_class(name).__init__).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def get_reader(name: str, **options: Any) -> DatasetReader:
    """The reader called ``name``, configured with ``options`` (validated by name)."""
    valid = reader_options(name)
    if unknown := sorted(set(options) - set(valid)):
        raise DatasetError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"for dataset {name!r}",
            at=f"calibration dataset {name!r}",
            why=f"valid options: {_describe_options(valid)}",
            next="remove or rename the option",
        )
    required = [k for k, d in valid.items() if d is inspect.Parameter.empty]
    if missing := [k for k in required if k not in options]:
        raise DatasetError(
            f"dataset {name!r} needs option{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))}",
            at=f"calibration dataset {name!r}",
            why=f"options: {_describe_options(valid)}",
            next=f"add {missing[0]}=... (e.g. the folder of your .npz files)",
        )
    return _reader_class(name)(**options)


def _reader_class(name: str) -> type:
    if name not in READERS:
        raise DatasetError(
            f"unknown dataset {name!r}",
            at="calibration dataset",
            why=f"valid datasets: {', '.join(reader_names())}",
            next="use one of those names (npz reads your own arrays from a folder)",
        )
    return READERS[name]


def _describe_options(valid: dict[str, Any]) -> str:
    if not valid:
        return "none (this dataset takes no options)"
    return ", ".join(
        k if d is inspect.Parameter.empty else f"{k} (default {d!r})" for k, d in valid.items()
    )

"""Calibration and evaluation data for qcompile, and the calibration methods (observers).

Readers (``get_reader(name, **options)``; names from ``reader_names()``) all follow
:class:`calibration.protocol.DatasetReader`: ``reader.batches(spec, batch_size=..., num_batches=...,
split="calibration" | "evaluation")`` yields :class:`Batch` objects shaped for the model's
:class:`InputSpec`. Calibration methods live in :mod:`calibration.methods`.
"""

from calibration.protocol import Batch, DatasetReader, InputKind, InputSpec
from calibration.readers.sentences import load_sentences
from calibration.registry import get_reader, reader_names, reader_options

__all__ = [
    "Batch",
    "DatasetReader",
    "InputKind",
    "InputSpec",
    "get_reader",
    "load_sentences",
    "reader_names",
    "reader_options",
]

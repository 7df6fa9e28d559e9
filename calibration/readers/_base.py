"""Helpers every reader shares: argument checks, normalisation, batching of in-memory samples."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from calibration.protocol import Batch, InputSpec
from qcompile.errors import DatasetError

SPLITS = ("calibration", "evaluation")


def describe(spec: InputSpec) -> str:
    """One line naming what a model takes, for error messages."""
    inputs = ", ".join(
        f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=False)
    )
    return f"kind {spec.kind!r}, inputs [{inputs}]"


def check_split(reader: str, split: str) -> None:
    """Raise a DatasetError unless ``split`` is one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise DatasetError(
            f"unknown split {split!r}",
            at=f"dataset reader {reader!r}",
            why=f"valid splits are {', '.join(SPLITS)}",
            next="pass split='calibration' or split='evaluation'",
        )


def check_batching(reader: str, batch_size: int, num_batches: int | None) -> None:
    """Raise a DatasetError unless ``batch_size`` is positive and ``num_batches`` is None or ≥ 0."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise DatasetError(
            f"batch_size must be a positive integer, not {batch_size!r}",
            at=f"dataset reader {reader!r}",
            next="set the calibration batch size to 1 or more",
        )
    bad = not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0
    if num_batches is not None and bad:
        raise DatasetError(
            f"num_batches must be a non-negative integer or None, not {num_batches!r}",
            at=f"dataset reader {reader!r}",
            next="set the number of calibration batches to 0 or more (None reads all data)",
        )


def kind_mismatch(reader: str, spec: InputSpec, fits: str) -> DatasetError:
    """The error for a reader asked to feed a model whose inputs it cannot make."""
    return DatasetError(
        f"dataset {reader!r} cannot feed this model",
        at=f"dataset reader {reader!r}, model takes {describe(spec)}",
        why=f"{reader!r} fits only {fits}",
        next="choose another dataset ('random' or 'npz' feed any model; see reader_names())",
    )


def normalise(x: torch.Tensor, spec: InputSpec, reader: str) -> torch.Tensor:
    """``(x - mean) / std`` per channel (dim 1) when the spec has them, else ``x`` unchanged."""
    if spec.mean is None and spec.std is None:
        return x
    channels = x.shape[1]
    mean = spec.mean if spec.mean is not None else (0.0,) * channels
    std = spec.std if spec.std is not None else (1.0,) * channels
    if len(mean) != channels or len(std) != channels:
        raise DatasetError(
            f"image normalisation has {len(mean)} mean / {len(std)} std values for "
            f"{channels} channels",
            at=f"dataset reader {reader!r}, model takes {describe(spec)}",
            why="InputSpec.mean and InputSpec.std need one value per input channel",
            next=f"give {channels} values each (or None to feed [0, 1] pixels)",
        )
    shape = (1, channels) + (1,) * (x.dim() - 2)
    mean_t = torch.tensor(mean, dtype=x.dtype).reshape(shape)
    std_t = torch.tensor(std, dtype=x.dtype).reshape(shape)
    return (x - mean_t) / std_t


def slices(n: int, batch_size: int, num_batches: int | None) -> Iterator[slice]:
    """Consecutive slices of ``batch_size`` over ``n`` samples (the last may be shorter)."""
    for i, start in enumerate(range(0, n, batch_size)):
        if num_batches is not None and i >= num_batches:
            return
        yield slice(start, min(start + batch_size, n))


def batched(
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor | None,
    batch_size: int,
    num_batches: int | None,
) -> Iterator[Batch]:
    """Cut in-memory samples (batch dimension first) into :class:`Batch` objects.

    Each batch is a copy, so callers may modify it without touching a reader's cache.
    """
    n = inputs[0].shape[0] if inputs else 0
    for s in slices(n, batch_size, num_batches):
        yield Batch(
            tuple(x[s].clone() for x in inputs),
            None if labels is None else labels[s].clone(),
        )


def cast_inputs(inputs: tuple[torch.Tensor, ...], spec: InputSpec) -> tuple[torch.Tensor, ...]:
    """Cast each input to the dtype the spec asks for."""
    return tuple(x.to(dtype) for x, dtype in zip(inputs, spec.dtypes, strict=True))

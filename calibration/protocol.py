"""The one protocol every calibration / evaluation dataset reader implements.

A reader knows its raw data (photos, digits, sentences, a user's ``.npz`` files, random numbers);
the model says what it eats through an :class:`InputSpec` (shapes, dtypes, image normalisation,
tokenizer). ``reader.batches(spec, ...)`` adapts one to the other, so any reader can feed any model
whose input kind it understands, and says clearly when it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

InputKind = Literal["image", "tokens", "tensor"]


@dataclass(frozen=True)
class InputSpec:
    """What a model takes: one entry per positional input, batch dimension first.

    ``shapes[i][0]`` is the example batch size; readers replace it with the batch size asked for.
    ``kind`` tells readers how to make inputs: ``image`` (N,C,H,W float, normalised with
    ``mean``/``std`` per channel), ``tokens`` (``input_ids`` and ``attention_mask`` int64 of
    shape (N, seq_len) made with ``tokenizer``), or ``tensor`` (anything else; only ``random`` and
    ``npz`` readers can feed it).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kind: InputKind = "tensor"
    names: tuple[str, ...] = ()
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # tokenizer(list[str], seq_len) -> (input_ids, attention_mask), both int64 (N, seq_len)
    tokenizer: Callable[[list[str], int], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, compare=False
    )

    def with_batch(self, batch_size: int) -> InputSpec:
        shapes = tuple((batch_size, *s[1:]) for s in self.shapes)
        return InputSpec(shapes, self.dtypes, self.kind, self.names, self.mean, self.std,
                         self.tokenizer)


@dataclass(frozen=True)
class Batch:
    """Model inputs for one batch, plus labels when the data has them (class ids, or scores)."""

    inputs: tuple[torch.Tensor, ...]
    labels: torch.Tensor | None = None


@runtime_checkable
class DatasetReader(Protocol):
    """A source of batches. ``split`` is ``"calibration"`` or ``"evaluation"``; readers with a
    natural train/test split (digits) map calibration to train and evaluation to held-out data,
    others use disjoint halves of their samples so calibration data is never evaluation data."""

    name: str

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]: ...

    def num_samples(self, split: str) -> int | None:
        """Samples available in ``split`` (``None`` when unbounded, e.g. random data)."""
        ...

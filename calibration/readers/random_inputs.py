"""``random``: seeded random inputs for any model (unbounded; smoke tests and quick calibration)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from calibration.protocol import Batch, InputSpec
from calibration.readers._base import SPLITS, check_batching, check_split, normalise
from qcompile.errors import DatasetError

TOKEN_ID_RANGE = (1000, 29000)  # ordinary word pieces in a BERT-size vocabulary, no special ids
PAD_ID = 0


class RandomReader:
    """Random inputs shaped like ``spec``, reproducible from ``seed``.

    * float inputs: normal(0, 1); for ``kind="image"`` uniform [0, 1] pixels normalised with the
      spec's mean/std, as a real image would be.
    * integer inputs: token ids uniform in [1000, 29000); inputs named ``*mask*`` (or the second
      input of a ``tokens`` model) are attention masks: all ones, or a random length per row
      with ``padding=True`` (ids past that length become the pad id 0).

    The two splits draw from different streams, so calibration and evaluation data differ.
    There is no end: ``num_batches`` is required.
    """

    name = "random"

    def __init__(self, *, seed: int = 0, padding: bool = False) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise DatasetError(
                f"option 'seed' must be a non-negative integer, not {seed!r}",
                at="dataset reader 'random'",
                next="pass e.g. seed=0",
            )
        if not isinstance(padding, bool):
            raise DatasetError(
                f"option 'padding' must be true or false, not {padding!r}",
                at="dataset reader 'random'",
                next="pass padding=True for random-length attention masks",
            )
        self.seed, self.padding = seed, padding

    def num_samples(self, split: str) -> int | None:
        """Always ``None``: random data never runs out."""
        check_split(self.name, split)
        return None

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """``num_batches`` batches of ``batch_size`` random samples."""
        check_split(self.name, split)
        check_batching(self.name, batch_size, num_batches)
        if num_batches is None:
            raise DatasetError(
                "dataset 'random' needs a number of batches",
                at="dataset reader 'random'",
                why="random data is unbounded, so 'all batches' never ends",
                next="set num_batches (the recipe's calibration 'batches')",
            )
        gen = torch.Generator().manual_seed(self.seed * len(SPLITS) + SPLITS.index(split))
        for _ in range(num_batches):
            yield Batch(self._inputs(spec.with_batch(batch_size), gen))

    def _inputs(self, spec: InputSpec, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        lengths = None
        inputs = []
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
            if dtype.is_floating_point:
                inputs.append(_float_input(spec, shape, dtype, gen))
                continue
            if lengths is None:
                lengths = self._lengths(shape, gen)
            if _is_mask(spec, i):
                inputs.append(_mask(shape, lengths).to(dtype))
            else:
                inputs.append(_token_ids(shape, dtype, lengths, gen))
        return tuple(inputs)

    def _lengths(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | None:
        """One valid length per row (padding along the last dim), or None for full masks."""
        if not self.padding or len(shape) < 2:
            return None
        return torch.randint(1, shape[-1] + 1, shape[:-1], generator=gen)


def _is_mask(spec: InputSpec, index: int) -> bool:
    if index < len(spec.names):
        return "mask" in spec.names[index].lower()
    return spec.kind == "tokens" and index == 1


def _float_input(
    spec: InputSpec, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    if spec.kind == "image" and len(shape) == 4:
        pixels = torch.rand(shape, generator=gen)
        return normalise(pixels, spec, RandomReader.name).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def _valid(shape: tuple[int, ...], lengths: torch.Tensor | None) -> torch.Tensor:
    if lengths is None:
        return torch.ones(shape, dtype=torch.bool)
    return torch.arange(shape[-1]) < lengths.unsqueeze(-1)


def _mask(shape: tuple[int, ...], lengths: torch.Tensor | None) -> torch.Tensor:
    return _valid(shape, lengths).to(torch.int64)


def _token_ids(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    lengths: torch.Tensor | None,
    gen: torch.Generator,
) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    low, high = TOKEN_ID_RANGE
    if torch.iinfo(dtype).max < high:  # narrow integer inputs are not token ids: any value fits
        low, high = 0, torch.iinfo(dtype).max + 1
    ids = torch.randint(low, high, shape, generator=gen)
    ids = torch.where(_valid(shape, lengths), ids, PAD_ID)
    return ids.to(dtype)

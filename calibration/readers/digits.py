"""``digits``: scikit-learn's 8x8 handwritten digits, with labels, for (N, 1, 8, 8) image models."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from calibration.digits import digits_split
from calibration.protocol import Batch, InputSpec
from calibration.readers._base import (
    batched,
    check_batching,
    check_split,
    kind_mismatch,
    normalise,
)

FITS = "image models taking one float input of shape (N, 1, 8, 8), e.g. the zoo's digits CNN"
SOURCE_SPLIT = {"calibration": "train", "evaluation": "test"}


class DigitsReader:
    """Digits images in [0, 1] (normalised with the spec's mean/std) and their class labels.

    ``calibration`` is the training part of :func:`calibration.digits.digits_split`,
    ``evaluation`` the held-out part, the same split the digits CNN was trained on.
    """

    name = "digits"

    def num_samples(self, split: str) -> int | None:
        """Images in ``split`` (1347 calibration, 450 evaluation)."""
        check_split(self.name, split)
        return len(digits_split(SOURCE_SPLIT[split])[1])

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """Batches of images with labels (int64 class ids), in the split's fixed order."""
        check_split(self.name, split)
        check_batching(self.name, batch_size, num_batches)
        if not fits(spec):
            raise kind_mismatch(self.name, spec, FITS)
        images, labels = digits_split(SOURCE_SPLIT[split])
        x = normalise(torch.from_numpy(images), spec, self.name).to(spec.dtypes[0])
        yield from batched((x,), torch.from_numpy(labels), batch_size, num_batches)


def fits(spec: InputSpec) -> bool:
    """True when ``spec`` is one (N, 1, 8, 8) float image input."""
    return (
        spec.kind == "image"
        and len(spec.shapes) == 1
        and tuple(spec.shapes[0][1:]) == (1, 8, 8)
        and spec.dtypes[0].is_floating_point
    )

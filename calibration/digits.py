"""scikit-learn's handwritten digits (1797 8x8 images, shipped with the package).

One fixed, stratified split is shared by the digits CNN's training (``qcompile.zoo``) and the
``digits`` reader, so calibration never sees held-out images and evaluation never sees
training ones.
"""

from __future__ import annotations

from functools import cache

import numpy as np

SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25


@cache
def _split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]  # N,1,8,8 in [0, 1]
    labels = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=HELD_OUT_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    return {"train": (x_tr, y_tr), "test": (x_te, y_te)}


def digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``("train" | "test") -> (images float32 N×1×8×8 in [0, 1], labels int64 N)``."""
    if split not in ("train", "test"):
        raise ValueError(f"digits split must be 'train' or 'test', not {split!r}")
    x, y = _split()[split]
    return x.copy(), y.copy()

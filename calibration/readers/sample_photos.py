"""``sample_photos``: real photos shipped inside scikit-image, scikit-learn and matplotlib.

Thirteen photos (people, animals, objects, scenes, space, a retina; gray ones copied to three
channels) become 104 inputs: four crop windows per photo, at different positions and scales, each
also mirrored. Crops are resized to the model's H×W with an antialiased bilinear filter, so one
set of photos fits any 3-channel image model. Nothing is downloaded: only files present inside the
installed packages are read (``skimage.data``'s fetcher is never called).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from calibration.protocol import Batch, InputSpec
from calibration.readers._base import (
    SPLITS,
    batched,
    check_batching,
    check_split,
    kind_mismatch,
    normalise,
)
from qcompile.errors import DatasetError

FITS = "image models taking one float input of shape (N, 3, H, W)"
SKIMAGE_PHOTOS = (
    "astronaut.png",
    "coffee.png",
    "chelsea.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "camera.png",
    "moon.png",
    "coins.png",
)
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")
MATPLOTLIB_PHOTOS = ("grace_hopper.jpg",)
PIP_NAMES = {"skimage": "scikit-image", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}
# (scale of the largest window with the model's aspect ratio, vertical, horizontal position in
# the free space). Consecutive windows alternate between the splits (even/odd crop index).
WINDOWS = ((1.0, 0.5, 0.5), (0.8, 0.0, 0.0), (0.6, 0.3, 0.7), (0.8, 1.0, 1.0))


class SamplePhotosReader:
    """Crops of the shipped sample photos as (N, 3, H, W) inputs in the spec's normalisation.

    Crops come in a fixed order (photo, mirrored, window); ``calibration`` takes the even crop
    indices (the whole-photo and the small off-centre window of each photo, plain and mirrored),
    ``evaluation`` the odd ones (the two corner windows), so no crop is in both splits.
    There are no labels.
    """

    name = "sample_photos"

    def num_samples(self, split: str) -> int | None:
        """Crops in ``split``: half of the 8 crops per photo (52 each)."""
        check_split(self.name, split)
        return len(photo_paths()) * len(WINDOWS)

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """Batches of crops resized to the spec's H×W, normalised with its mean/std."""
        check_split(self.name, split)
        check_batching(self.name, batch_size, num_batches)
        if not fits(spec):
            raise kind_mismatch(self.name, spec, FITS)
        height, width = spec.shapes[0][2:]
        crops = photo_crops(height, width)[SPLITS.index(split) :: 2]
        x = normalise(crops, spec, self.name).to(spec.dtypes[0])
        yield from batched((x,), None, batch_size, num_batches)


def fits(spec: InputSpec) -> bool:
    """True when ``spec`` is one (N, 3, H, W) float image input."""
    return (
        spec.kind == "image"
        and len(spec.shapes) == 1
        and len(spec.shapes[0]) == 4
        and spec.shapes[0][1] == 3
        and spec.dtypes[0].is_floating_point
    )


def photo_paths() -> tuple[Path, ...]:
    """The photo files read, in order; each one checked to exist inside its package."""
    folders = (
        (_package_dir("skimage") / "data", SKIMAGE_PHOTOS),
        (_package_dir("sklearn") / "datasets" / "images", SKLEARN_PHOTOS),
        (_package_dir("matplotlib") / "mpl-data" / "sample_data", MATPLOTLIB_PHOTOS),
    )
    paths = tuple(folder / name for folder, names in folders for name in names)
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise DatasetError(
            f"sample photos missing from the installed packages: {', '.join(missing)}",
            at="dataset reader 'sample_photos'",
            why="the reader only reads photos shipped inside scikit-image, scikit-learn and "
            "matplotlib; it never downloads",
            next="reinstall those packages, or use another dataset (e.g. 'npz' with your images)",
        )
    return paths


def _package_dir(package: str) -> Path:
    """Where ``package`` is installed, found without importing it (the imports are slow)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            f"package {package!r} is not installed",
            at="dataset reader 'sample_photos'",
            why="the sample photos are the ones shipped inside scikit-image, scikit-learn and "
            "matplotlib",
            next=f"pip install {PIP_NAMES[package]}",
        )
    return Path(spec.submodule_search_locations[0])


@cache
def _photos() -> tuple[torch.Tensor, ...]:
    """Each photo decoded once: float32 (3, h, w) in [0, 1]."""
    from PIL import Image

    photos = []
    for path in photo_paths():
        with Image.open(path) as image:
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        photos.append(torch.from_numpy(rgb).permute(2, 0, 1).contiguous())
    return tuple(photos)


@cache
def photo_crops(height: int, width: int) -> torch.Tensor:
    """All crops, float32 (N, 3, height, width) in [0, 1], in (photo, mirror, window) order.

    Cached per size; callers must not modify the tensor (readers hand out copies).
    """
    crops = []
    for photo in _photos():
        plain = [_resize(_crop(photo, w, height / width), height, width) for w in WINDOWS]
        crops += plain + [crop.flip(-1) for crop in plain]
    return torch.stack(crops)


def _crop(photo: torch.Tensor, window: tuple[float, float, float], aspect: float) -> torch.Tensor:
    """The window of ``photo`` with height/width ratio ``aspect``."""
    scale, fy, fx = window
    h, w = photo.shape[1:]
    crop_h, crop_w = (h, h / aspect) if h / aspect <= w else (w * aspect, w)
    crop_h, crop_w = max(1, round(crop_h * scale)), max(1, round(crop_w * scale))
    top, left = round((h - crop_h) * fy), round((w - crop_w) * fx)
    return photo[:, top : top + crop_h, left : left + crop_w]


def _resize(crop: torch.Tensor, height: int, width: int) -> torch.Tensor:
    resized = F.interpolate(
        crop[None], size=(height, width), mode="bilinear", antialias=True, align_corners=False
    )
    return resized[0].clamp(0.0, 1.0)

"""``npz``: a user's own data, a folder of ``.npz`` files (``np.savez``), checked against the model.

Layout of the folder given as option ``path``::

    data/                      data/
      part-000.npz      or       calibration/part-000.npz ...
      part-001.npz               evaluation/part-000.npz ...

Without ``calibration/`` and ``evaluation/`` subfolders the same files serve both splits (so
evaluation then measures on the calibration data). Files are read in name order. Each file holds
one array per model input, batch dimension first, named like the model's inputs
(``InputSpec.names``) or positionally ``arr_0, arr_1, ...`` (``np.savez(f, x, m)``) or
``input_0, input_1, ...``; an optional ``labels`` array (class ids or scores) has the same leading
dimension. Arrays are loaded with ``allow_pickle=False``: object arrays and pickles are refused.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from calibration.protocol import Batch, InputSpec
from calibration.readers._base import SPLITS, batched, check_batching, check_split, describe
from qcompile.errors import DatasetError

Arrays = dict[str, np.ndarray]
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
NPY_MAGIC = b"\x93NUMPY"
SAVE_HINT = "write it with np.savez(path, input_name=array, ..., labels=labels)"


class NpzReader:
    """Batches from a folder of ``.npz`` files; see the module docstring for the layout."""

    name = "npz"

    def __init__(self, *, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise _error(
                f"npz folder not found: {self.path}",
                self.path,
                why="option 'path' must name an existing folder of .npz files",
                next=f"check the path (relative paths start at {Path.cwd()})",
            )
        if not self.path.is_dir():
            raise _error(
                f"npz path is a file, not a folder: {self.path}",
                self.path,
                why="the npz reader reads every .npz file in a folder",
                next=f"move the file into a folder and pass path={str(self.path.parent)!r}",
            )

    def num_samples(self, split: str) -> int | None:
        """Samples in ``split``: the leading dimension summed over its files."""
        check_split(self.name, split)
        return sum(_leading_dim(path, _load(path)) for path in self.files(split))

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """Batches across all files of ``split``; every file is checked before the first batch."""
        check_split(self.name, split)
        check_batching(self.name, batch_size, num_batches)
        parts = [_match(path, _load(path), spec) for path in self.files(split)]
        inputs, labels = _concat(parts, spec)
        yield from batched(inputs, labels, batch_size, num_batches)

    def files(self, split: str) -> list[Path]:
        """The ``.npz`` files of ``split``, in name order."""
        folder = self._folder(split)
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        if strays := [p.name for p in entries if p.is_file() and p.suffix != ".npz"]:
            raise _error(
                f"npz folder holds files that are not .npz: {', '.join(strays)}",
                folder,
                why="every file in the folder is read as model inputs",
                next="remove or move those files, or convert them: " + SAVE_HINT,
            )
        files = [p for p in entries if p.is_file()]
        if not files:
            raise _error(
                f"npz folder has no .npz files: {folder}",
                folder,
                why="there is nothing to calibrate or evaluate on",
                next=SAVE_HINT,
            )
        return files

    def _folder(self, split: str) -> Path:
        present = [s for s in SPLITS if (self.path / s).is_dir()]
        if not present:
            return self.path
        if len(present) == 1:
            missing = next(s for s in SPLITS if s not in present)
            raise _error(
                f"npz folder has a {present[0]}/ subfolder but no {missing}/ subfolder",
                self.path,
                why="with split subfolders each split reads only its own folder",
                next=f"add {self.path / missing}/ or move the files up and remove "
                f"{self.path / present[0]}/ to use the same files for both splits",
            )
        return self.path / split


def _error(
    what: str, where: Path, *, why: str, next: str, array: str | None = None
) -> DatasetError:
    at = f"dataset 'npz', {where}" + (f", array {array!r}" if array else "")
    return DatasetError(what, at=at, why=why, next=next)


def _load(path: Path) -> Arrays:
    """All arrays of one file, refusing anything that is not a plain numeric ``.npz``."""
    _check_magic(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise _corrupt(path, e) from e
        raise _error(
            f"{path.name} holds an object array (pickled Python objects)",
            path,
            why="allow_pickle is off: loading pickles can run arbitrary code",
            next="save plain numeric arrays (e.g. np.asarray(x, dtype=np.float32))",
        ) from e
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise _corrupt(path, e) from e


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:4] in ZIP_MAGIC:
        return
    if head.startswith(NPY_MAGIC):
        why = "it is a single .npy array (np.save), not an .npz archive (np.savez)"
    elif head[:1] == b"\x80":
        why = "it holds pickled data, and allow_pickle is off: loading pickles can run code"
    elif not head:
        why = "the file is empty"
    else:
        why = "it is not a zip archive as written by np.savez"
    raise _error(f"{path.name} is not a valid .npz file", path, why=why, next=SAVE_HINT)


def _corrupt(path: Path, e: Exception) -> DatasetError:
    return _error(
        f"{path.name} is corrupt or truncated",
        path,
        why=f"numpy could not read it: {e}",
        next="write the file again: " + SAVE_HINT,
    )


def _leading_dim(path: Path, arrays: Arrays) -> int:
    inputs = [a for k, a in arrays.items() if k != "labels"]
    if not inputs or inputs[0].ndim == 0:
        raise _error(
            f"{path.name} has no input arrays with a batch dimension",
            path,
            why=f"found arrays {sorted(arrays)}",
            next=SAVE_HINT,
        )
    return int(inputs[0].shape[0])


def _match(
    path: Path, arrays: Arrays, spec: InputSpec
) -> tuple[list[np.ndarray], np.ndarray | None]:
    """This file's arrays in the model's input order, each checked against the spec."""
    labels = arrays.pop("labels", None)
    order = _input_order(path, list(arrays), spec)
    inputs = [arrays[k] for k in order]
    for key, array, shape, dtype in zip(order, inputs, spec.shapes, spec.dtypes, strict=True):
        _check_array(path, key, array, shape, dtype)
    _check_batch_dims(path, dict(zip(order, inputs, strict=True)), labels)
    return inputs, labels


def _input_order(path: Path, keys: list[str], spec: InputSpec) -> list[str]:
    n = len(spec.shapes)
    candidates = [list(spec.names)] if len(spec.names) == n else []
    candidates += [[f"arr_{i}" for i in range(n)], [f"input_{i}" for i in range(n)]]
    expected = " or ".join(str(c) for c in candidates)
    if len(keys) != n:
        raise _error(
            f"{path.name} holds {len(keys)} input arrays {sorted(keys)}, the model takes {n}",
            path,
            why=f"every array except 'labels' is a model input; expected {expected}",
            next=SAVE_HINT,
        )
    for names in candidates:
        if set(names) == set(keys):
            return names
    raise _error(
        f"{path.name} has arrays {sorted(keys)}, which do not name the model's inputs",
        path,
        why=f"expected {expected} (plus optional 'labels')",
        next=SAVE_HINT,
    )


def _check_array(
    path: Path, key: str, array: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    want = _numpy_dtype(dtype)
    if (
        array.ndim == 0
        or array.dtype.kind not in "biuf"
        or not np.can_cast(array.dtype, want, casting="same_kind")
    ):
        raise _error(
            f"{path.name}: array {key!r} has dtype {array.dtype}, the model takes {want}",
            path,
            array=key,
            why=f"expected a numeric array castable to {want} (same kind: ints/bools to "
            "ints or floats, floats to floats)",
            next=f"save it with array.astype(np.{want})",
        )
    if tuple(array.shape[1:]) != tuple(shape[1:]):
        expected = ("N", *shape[1:])
        raise _error(
            f"{path.name}: array {key!r} has shape {tuple(array.shape)}, expected "
            f"({', '.join(map(str, expected))})",
            path,
            array=key,
            why="after the leading batch dimension every input must match the model's shape",
            next="resize or reshape the data to the model's input shape",
        )


def _check_batch_dims(path: Path, inputs: Arrays, labels: np.ndarray | None) -> None:
    sizes = {key: a.shape[0] for key, a in inputs.items()}
    if labels is not None:
        sizes["labels"] = labels.shape[0] if labels.ndim else -1
        if labels.dtype.kind not in "biuf":
            raise _error(
                f"{path.name}: 'labels' has dtype {labels.dtype}, expected numbers",
                path,
                array="labels",
                why="labels are class ids or scores",
                next=SAVE_HINT,
            )
    if len(set(sizes.values())) > 1:
        raise _error(
            f"{path.name}: arrays disagree on the batch size: {sizes}",
            path,
            why="every array holds one row per sample along dimension 0",
            next="save the same number of samples in every array",
        )


def _concat(
    parts: list[tuple[list[np.ndarray], np.ndarray | None]], spec: InputSpec
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    inputs = tuple(
        torch.cat([_tensor(p[0][i]).to(dtype) for p in parts])
        for i, dtype in enumerate(spec.dtypes)
    )
    with_labels = [p[1] is not None for p in parts]
    if any(with_labels) and not all(with_labels):
        raise DatasetError(
            "some .npz files have 'labels' and others do not",
            at=f"dataset 'npz', model takes {describe(spec)}",
            why="labels are used for every sample or for none",
            next="add 'labels' to every file or remove it from all",
        )
    if not all(with_labels):
        return inputs, None
    return inputs, torch.cat([_tensor(p[1]) for p in parts if p[1] is not None])


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 & co have no numpy twin: float32 data is cast on the way in
        return np.dtype(np.float32)

"""Several compiled sequence lengths of a token model, one runner each.

QIR is static-shaped, so a token model compiled for lengths ``16, 32, 64, 128`` holds one runner
(per-batch modules) per length. A call with inputs of ``L`` tokens runs the smallest compiled
length ``L' >= L``: ``input_ids`` and ``attention_mask`` are padded with 0 (the pad id, and a mask
that hides the padded keys from every attention row), and each output dimension that is the
sequence length is sliced back to ``L``. Those dimensions are found by comparing the output shapes
of two compiled lengths (a pooled output such as MiniLM's ``(N, 384)`` has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from qcompile.errors import CompileError

PAD = 0   # pad id of BERT vocabularies, and the attention mask of a padded token


def compiled_length(lengths: Sequence[int], length: int) -> int:
    """The smallest compiled length that holds ``length`` tokens (the caller checked that one
    does)."""
    return min(n for n in lengths if n >= length)


def seq_dims(shapes: dict[int, Sequence[tuple[int, ...]]]) -> tuple[int | None, ...]:
    """Per output, the dimension that is the sequence length (or None), from the full output
    shapes (batch included) at two or more compiled lengths."""
    lengths = sorted(shapes)
    found: list[int | None] = []
    for i, first in enumerate(shapes[lengths[0]]):
        per_len = {n: shapes[n][i] for n in lengths}
        differ = [d for d in range(len(first))
                  if len({s[d] if d < len(s) else -1 for s in per_len.values()}) > 1]
        if not differ:
            found.append(None)
            continue
        if len(differ) > 1 or any(len(s) != len(first) or s[differ[0]] != n
                                  for n, s in per_len.items()):
            raise CompileError(
                f"output {i} changes shape with the sequence length in a way padding cannot undo",
                at=f"output {i}", why="shapes per compiled length: " + ", ".join(
                    f"{n}: {list(s)}" for n, s in per_len.items()) + "; only a dimension equal "
                "to the length can be sliced back",
                next="compile one length only (drop seq_lens), or return the per-token output "
                     "unflattened")
        found.append(differ[0])
    return tuple(found)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, length - int(x.shape[1])), value=PAD)


class SeqLenRunner:
    """Torch tensors of any length up to the longest compiled one in → the runner of the
    smallest length that holds them → outputs sliced back to the input's length.

    ``runners``: compiled length → that length's runner (each splits batches itself). ``main``:
    the calibration length, whose runner answers the attributes this class does not define
    (``modules``, ``graph``, ...): reports and checks read them at the length the evaluation
    data has."""

    def __init__(self, runners: dict[int, Any], dims: tuple[int | None, ...], main: int) -> None:
        self.runners, self.seq_dims, self.main = dict(sorted(runners.items())), dims, main

    @property
    def lengths(self) -> list[int]:
        return list(self.runners)

    def __getattr__(self, name: str) -> Any:
        if name in ("runners", "main"):   # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.runners[self.main], name)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        length = int(inputs[0].shape[1])
        target = compiled_length(self.lengths, length)
        out = self.runners[target](*[_pad(x, target) for x in inputs])
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        cut = [o if d is None or target == length else o.narrow(d, 0, length).contiguous()
               for o, d in zip(outs, self.seq_dims, strict=True)]
        return cut[0] if isinstance(out, torch.Tensor) else tuple(cut)

    def run_numpy(self, *inputs: np.ndarray) -> list[np.ndarray]:
        length = int(inputs[0].shape[1])
        target = compiled_length(self.lengths, length)
        padded = [np.pad(x, ((0, 0), (0, target - length)), constant_values=PAD) for x in inputs]
        outs = self.runners[target].run_numpy(*padded)
        return [o if d is None else np.ascontiguousarray(np.take(o, range(length), axis=d))
                for o, d in zip(outs, self.seq_dims, strict=True)]

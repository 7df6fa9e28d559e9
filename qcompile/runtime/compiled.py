"""``CompiledModel``: a model ready to run on one target, with its inputs checked at every call:
a dense CPU tensor per input, of the compiled dtype, rank and shape, a batch the model takes (and a
sequence length, for token models compiled at several), and, for float inputs, finite values.
Calls from several threads are safe (each target serialises what it must)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qcompile.errors import InputError, NonFiniteInput


@dataclass(frozen=True)
class InputSignature:
    """What one positional input must be. ``batch`` is ``None`` when any batch in
    ``1..max_batch`` is accepted, else the one compiled batch size. ``seq_lens``: the compiled
    sequence lengths of a token model compiled at several; then dim 1 takes any length up to the
    longest (``shape[0]``), and shorter inputs are padded to a compiled length."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]            # without the batch dimension
    batch: int | None
    max_batch: int
    seq_lens: tuple[int, ...] = ()

    def describe(self) -> str:
        b = f"1..{self.max_batch}" if self.batch is None else str(self.batch)
        dims = [f"1..{self.shape[0]}", *map(str, self.shape[1:])] if self.seq_lens else \
            list(map(str, self.shape))
        return f"{self.name}: {str(self.dtype).removeprefix('torch.')}[{b}, " + \
            ", ".join(dims) + "]"


@dataclass
class CompiledModel:
    """Torch tensors in, torch tensors out. ``report`` collects what the compiler measured."""

    target: str
    signature: tuple[InputSignature, ...]
    runner: Callable[..., Any]
    report: dict[str, Any] = field(default_factory=dict)
    # the runner's call for inputs that plainly fit (made on the first call; see __call__)
    _plain: Any = field(default=None, init=False, repr=False, compare=False)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        # A runner may offer a call for inputs that plainly fit the signature (``plain_call``:
        # dense contiguous CPU tensors of the compiled dtype, shape and a batch it runs whole),
        # which skips the steps below; it answers NotImplemented for anything else, which then
        # takes the full path, with its checks and errors. After the kernels ran, each Python
        # step here misses the caches: the full path costs about 50 µs a call.
        plain = self._plain
        if plain is None:
            make = getattr(self.runner, "plain_call", None)
            plain = self._plain = (make(self.signature) if make else None) or False
        if plain:
            try:
                out = plain(inputs)
            except NonFiniteInput:
                self.check_inputs(inputs)
                raise
            if out is not NotImplemented:
                return out
        # a runner whose kernels see every float input checks them for NaN and infinity on
        # the way (no pass over the inputs here); the error then names where, as below
        in_kernel = bool(getattr(self.runner, "checks_finite", False))
        self.check_inputs(inputs, finite=not in_kernel)
        with torch.no_grad():
            try:
                return self.runner(*inputs)
            except NonFiniteInput:
                self.check_inputs(inputs)
                raise

    def save(self, path: Any) -> Any:
        """Write this model as a ``.qca`` artifact (target ``cpu``); see
        :mod:`qcompile.runtime.artifact`."""
        from qcompile.runtime.artifact import save

        return save(self, path)

    def check_inputs(self, inputs: tuple[Any, ...], finite: bool = True) -> None:
        expected = ", ".join(s.describe() for s in self.signature)
        if len(inputs) != len(self.signature):
            raise InputError(f"expected {len(self.signature)} inputs, got {len(inputs)}",
                             at=f"CompiledModel({self.target}) call", why=f"inputs: {expected}",
                             next="pass one tensor per model input, in order")
        for i, (x, sig) in enumerate(zip(inputs, self.signature, strict=True)):
            problem = _input_problem(x, sig, finite)
            if problem:
                raise InputError(f"input {i} ({sig.name}) does not fit the compiled model",
                                 at=f"CompiledModel({self.target}) input {i}", why=problem,
                                 next=f"pass {sig.describe()}")
        lengths = [int(x.shape[1]) for x, s in zip(inputs, self.signature, strict=True)
                   if s.seq_lens]
        if len(set(lengths)) > 1:
            raise InputError(f"the inputs have different sequence lengths {lengths}",
                             at=f"CompiledModel({self.target}) call",
                             why="input_ids and attention_mask describe the same tokens",
                             next="pass inputs of one length (dim 1)")


def _input_problem(x: Any, sig: InputSignature, finite: bool = True) -> str | None:
    if not isinstance(x, torch.Tensor):
        return f"got a {type(x).__name__}, not a torch.Tensor"
    if x.is_nested or x.layout is not torch.strided:
        kind = "a nested tensor" if x.is_nested else f"a {x.layout} tensor"
        return f"got {kind}; compiled models read dense (strided) tensors (try .to_dense())"
    if x.device.type != "cpu":
        return f"tensor is on {x.device}; this target reads CPU tensors"
    if x.dtype != sig.dtype:
        return f"dtype is {x.dtype}, expected {sig.dtype}"
    if x.dim() != len(sig.shape) + 1:
        return f"rank is {x.dim()} (shape {list(x.shape)}), expected {len(sig.shape) + 1}"
    if sig.seq_lens:
        if problem := _seq_problem(x, sig):
            return problem
    elif tuple(x.shape[1:]) != sig.shape:
        return f"shape is {list(x.shape)}, expected [batch, {', '.join(map(str, sig.shape))}]"
    n = x.shape[0]
    if n == 0:
        return "the batch is empty"
    if sig.batch is not None and n != sig.batch:
        return f"batch size {n}; this model was compiled for batch {sig.batch} only"
    if n > sig.max_batch:
        return f"batch size {n} exceeds the maximum {sig.max_batch}"
    if finite and x.dtype.is_floating_point and not _all_finite(x):
        return _non_finite(x)
    return None


def _seq_problem(x: torch.Tensor, sig: InputSignature) -> str | None:
    """Dim 1 is a sequence length up to the longest compiled one; the rest as compiled."""
    if tuple(x.shape[2:]) != sig.shape[1:]:
        return f"shape is {list(x.shape)}, expected [batch, length, " + \
            ", ".join(map(str, sig.shape[1:])) + "]"
    length, longest = int(x.shape[1]), max(sig.seq_lens)
    if length == 0:
        return "the sequence is empty (length 0)"
    if length > longest:
        return (f"sequence length {length} exceeds the longest compiled length {longest} "
                f"(compiled lengths: {', '.join(map(str, sig.seq_lens))}); truncate the inputs "
                f"to {longest} tokens, or compile a longer length (recipe model.seq_lens, "
                f"quantize config seq_lens)")
    return None


def _all_finite(x: torch.Tensor) -> bool:
    """numpy for f32/f64: torch's parallel kernel leaves its OpenMP threads spinning, which took
    the cores from the IREE workers of the call that follows (resnet18 batch 1 on 2 cores: 6 ms
    of a 12 ms call)."""
    if x.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(x.detach().numpy()).all())
    return bool(torch.isfinite(x).all())


def _non_finite(x: torch.Tensor) -> str:
    """Int8 codes have no NaN or infinity, and a compiled quantize maps them to arbitrary codes:
    refused (see README, target cpu, "Inputs")."""
    bad = ~torch.isfinite(x)
    where = tuple(int(i) for i in bad.nonzero()[0])
    return (f"holds {int(bad.sum())} non-finite value(s), the first {x[where].item()} at index "
            f"{list(where)}; int8 models take finite inputs only")

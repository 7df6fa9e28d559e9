"""The model zoo: float models every part of qcompile (recipes, tests, benchmarks) builds by name.

``build(name)`` returns a :class:`ZooModel`: the float32 module in eval mode plus what it eats
(an :class:`~calibration.protocol.InputSpec`), its task and the calibration reader that fits it.
Everything is offline and deterministic: random-init models are seeded, real weights come from
installed packages, the digits CNN is trained in-project once and cached.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass

import torch

from calibration.protocol import InputSpec
from qcompile.errors import ModelError

__all__ = ["ZooModel", "build", "names"]

EXAMPLE_SEED = 1234
FIRST_WORD_ID = 1000  # BERT vocabularies keep ids below ~1000 for [PAD], [unused*], [CLS], ...
TOKEN_MODELS = ("bert_encoder", "minilm")

# name -> "module:function" under qcompile.zoo, imported on first build so that importing the zoo
# stays cheap (transformers, the weights packages and sklearn load only when needed).
_REGISTRY: dict[str, str] = {
    "resnet18": "resnet:build_resnet18",
    "resnet50": "resnet:build_resnet50",
    "mobilenet_v2": "mobilenet_v2:build",
    "efficientnet_lite0": "efficientnet_lite:build",
    "bert_encoder": "bert:build",
    "minilm": "minilm:build",
    "mlp": "mlp:build",
    "digits_cnn": "digits_cnn:build",
}


@dataclass(frozen=True)
class ZooModel:
    """A float model of the zoo and what it takes.

    ``spec`` holds batch-1 example shapes; ``task`` is ``"classification"`` (logits),
    ``"embedding"`` or ``"regression"``; ``default_dataset`` names a calibration reader.
    """

    name: str
    module: torch.nn.Module
    spec: InputSpec
    task: str
    default_dataset: str
    description: str

    def example_inputs(self, batch_size: int = 1) -> tuple[torch.Tensor, ...]:
        """Deterministic inputs of ``spec.with_batch(batch_size)``.

        Images are uniform [0, 1] pixels normalised with the spec's mean/std; tokens are word ids
        within the vocabulary with a full attention mask; other tensors are standard normal.
        """
        spec = self.spec.with_batch(batch_size)
        gen = torch.Generator().manual_seed(EXAMPLE_SEED)
        if spec.kind == "tokens":
            ids = torch.randint(FIRST_WORD_ID, self._vocab_size(), spec.shapes[0], generator=gen)
            return ids, torch.ones_like(ids)
        if spec.kind == "image":
            return tuple(_normalised_image(shape, spec, gen) for shape in spec.shapes)
        return tuple(
            _random_tensor(shape, dtype, gen)
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        )

    def _vocab_size(self) -> int:
        # The word embedding is the first embedding table of every token model in the zoo.
        for m in self.module.modules():
            if isinstance(m, torch.nn.Embedding):
                return m.num_embeddings
        raise ModelError(f"zoo model {self.name!r} takes tokens but has no embedding table")


def _normalised_image(
    shape: tuple[int, ...], spec: InputSpec, gen: torch.Generator
) -> torch.Tensor:
    pixels = torch.rand(shape, generator=gen)
    channels = shape[1]
    mean = torch.tensor(spec.mean or (0.0,) * channels).view(1, -1, 1, 1)
    std = torch.tensor(spec.std or (1.0,) * channels).view(1, -1, 1, 1)
    return (pixels - mean) / std


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen, dtype=dtype)


def names() -> tuple[str, ...]:
    """Names of all zoo models, in registry order."""
    return tuple(_REGISTRY)


def build(name: str, *, seq_len: int | None = None) -> ZooModel:
    """Build zoo model ``name`` (float32, eval mode).

    ``seq_len`` sets the token length of the token models (``bert_encoder``, ``minilm``; default
    128). Raises :class:`~qcompile.errors.ModelError` for an unknown name or a bad ``seq_len``.
    """
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(
            f"unknown zoo model {name!r}",
            why=f"valid names: {', '.join(names())}",
            next=f"{hint}use one of the valid names, or 'module:function'",
        )
    if seq_len is not None and name not in TOKEN_MODELS:
        raise ModelError(
            f"zoo model {name!r} takes no seq_len (got {seq_len})",
            why=f"only the token models take one: {', '.join(TOKEN_MODELS)}",
            next="drop seq_len for this model",
        )
    if seq_len is not None and seq_len < 1:
        raise ModelError(f"seq_len must be at least 1, not {seq_len}", at=f"zoo model {name!r}")
    module_name, function = _REGISTRY[name].split(":")
    builder = getattr(importlib.import_module(f"qcompile.zoo.{module_name}"), function)
    return builder(seq_len)

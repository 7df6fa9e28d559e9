"""Tiny models for the robustness tests: quantize in well under a second, compile for cpu in a
few seconds."""

from __future__ import annotations

import torch
from torch import nn

from qcompile.frontend.quantize import QuantizeConfig, QuantizedModel, quantize


class Block(nn.Module):
    """conv-relu, maxpool, a residual conv + add, flatten, linear: every int8 chain kind."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.max_pool2d(torch.relu(self.a(x)), 2)
        y = torch.relu(self.b(y) + y)
        return self.fc(torch.flatten(y, 1))


def block_inputs(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def quantized_block() -> QuantizedModel:
    torch.manual_seed(0)
    batches = [(block_inputs(4, seed),) for seed in range(3)]
    return quantize(Block().eval(), batches[0], batches, QuantizeConfig(quantizer="qcompile"))


class FloatIsland(nn.Module):
    """conv → y / (sigmoid(y) + 1) → conv: a divide of two tensors has no int8 lowering, so it
    stays a float op between int8 chains (a fallback, or an error under ``float_ops: error``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y / (torch.sigmoid(y) + 1.0))


def float_island() -> nn.Module:
    torch.manual_seed(0)
    return FloatIsland().eval()


def block() -> nn.Module:
    """:class:`Block` as a recipe ``entry`` (``robustness_models:block``)."""
    torch.manual_seed(0)
    return Block().eval()


def block_recipe(extra: str = "", *, targets: str = "[cpu]") -> str:
    """A recipe for :func:`block`: random calibration data, a couple of batches, fast."""
    return ("version: 1\nname: block\n"
            "model: {entry: 'robustness_models:block', input_shapes: [[2, 3, 8, 8]]}\n"
            "quantizer: {kind: qcompile}\n"
            "calibration: {dataset: random, batches: 2, batch_size: 4}\n"
            "evaluation: {dataset: random, batches: 1, batch_size: 4}\n"
            f"targets: {targets}\n" + extra)

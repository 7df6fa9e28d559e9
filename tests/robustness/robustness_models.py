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

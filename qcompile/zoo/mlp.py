"""A transformer-style MLP block, 1024 -> 4096 -> ReLU -> 1024: one GEMM chain.

The input is (batch, 1024); recipes and benchmarks run it at batch 64 (a 64-row GEMM).
"""

from __future__ import annotations

import torch
from torch import nn

from calibration.protocol import InputSpec
from qcompile.zoo import ZooModel
from qcompile.zoo._common import seeded

DIM, HIDDEN = 1024, 4096


class MLP(nn.Module):
    """Linear(dim, hidden) -> ReLU -> Linear(hidden, dim)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def build(seq_len: int | None = None) -> ZooModel:
    """The MLP block with seeded default (Kaiming-uniform) init; input (batch, 1024) float32."""
    with seeded():
        module = MLP().eval()
    spec = InputSpec(shapes=((1, DIM),), dtypes=(torch.float32,), kind="tensor", names=("x",))
    return ZooModel(
        name="mlp",
        module=module,
        spec=spec,
        task="regression",
        default_dataset="random",
        description=f"MLP block {DIM}->{HIDDEN}->ReLU->{DIM}, seeded random init",
    )

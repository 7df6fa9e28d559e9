"""Tiny models shared by several test files (a module of its own: test files in sub-folders
have conftest modules of their own, so ``from conftest import ...`` is ambiguous)."""

from __future__ import annotations

import torch
from torch import nn


class TinyCNN(nn.Module):
    """conv-bn-relu, residual conv + add + relu, pool, flatten, linear: the CNN chain shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)
        self.unused = nn.Linear(8, 8)  # dead code: never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))

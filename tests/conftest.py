"""Shared fixtures: tiny models that quantize in well under a second."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyCNN
from torch import nn


@pytest.fixture
def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TinyCNN().eval()


@pytest.fixture
def tiny_batches() -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(4)]

"""Shared fixtures: tiny models that quantize in well under a second."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A fresh Triton cache for a test module: every compile really runs (a cached kernel would
    neither show its PTX being built nor reach the stage a fault test breaks)."""
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    yield
    if old is None:
        os.environ.pop("TRITON_CACHE_DIR")
    else:
        os.environ["TRITON_CACHE_DIR"] = old

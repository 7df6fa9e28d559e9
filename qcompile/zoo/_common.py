"""Helpers shared by the zoo's model files: seeding, BatchNorm statistics, input specs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from calibration.protocol import InputSpec

BUILD_SEED = 0
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_SEQ_LEN = 128


@contextmanager
def seeded(seed: int = BUILD_SEED) -> Iterator[None]:
    """Run the body with torch's CPU RNG seeded, restoring the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def calibrate_batchnorm(
    module: nn.Module, input_shape: tuple[int, ...], *, passes: int = 4, batch_size: int = 4
) -> None:
    """Give a randomly initialised network's BatchNorms the statistics of its own activations.

    Without this, eval-mode BatchNorm (mean 0, var 1) lets activations grow or vanish layer by
    layer; after it, every BatchNorm output is close to unit variance, as in a trained network.
    16 images of 224x224 give every channel >= 784 samples even at 7x7: plenty for a mean and
    variance. Uses the global RNG: call it inside :func:`seeded`. Leaves the module in eval mode.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over all passes
    module.train()
    with torch.no_grad():
        for _ in range(passes):
            module(torch.randn(batch_size, *input_shape))
    for bn, momentum in zip(norms, momenta, strict=True):
        bn.momentum = momentum
    module.eval()


def image_spec(
    channels: int, size: int, mean: tuple[float, ...], std: tuple[float, ...]
) -> InputSpec:
    """Spec of one NCHW float image input (batch 1), normalised from [0, 1] with mean/std."""
    return InputSpec(
        shapes=((1, channels, size, size),),
        dtypes=(torch.float32,),
        kind="image",
        names=("image",),
        mean=mean,
        std=std,
    )


def cache_dir() -> Path:
    """Where the zoo keeps what it computes: ``$QCOMPILE_CACHE_DIR``, else ~/.cache/qcompile."""
    return Path(os.environ.get("QCOMPILE_CACHE_DIR") or Path.home() / ".cache" / "qcompile")

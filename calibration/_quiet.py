"""Import torchao without its start-up chatter: it logs a warning for every optional CUDA kernel
library that cannot load on a CPU machine, and torch logs a deprecation note for one of its enums.
Neither concerns a qcompile user; real errors still raise."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_NOISY = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_torchao() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)

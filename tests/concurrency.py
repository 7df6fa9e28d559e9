"""Calls from several threads at once, for the tests of thread safety."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_in_threads(fn: Callable[..., Any], args: Iterable[tuple[Any, ...]],
                   timeout: float = 120.0) -> None:
    """``fn(*a)`` for each ``a`` in ``args``, each on a thread of its own, all started before
    any is joined; raises the first error one of them raised, and fails for a thread still
    running after ``timeout`` seconds."""
    errors: list[BaseException] = []

    def call(a: tuple[Any, ...]) -> None:
        try:
            fn(*a)
        except BaseException as err:  # noqa: BLE001 - raised in the caller below
            errors.append(err)

    threads = [threading.Thread(target=call, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a thread still runs after {timeout} s"
    if errors:
        raise errors[0]

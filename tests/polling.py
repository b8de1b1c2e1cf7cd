"""Waiting for a condition in tests: poll it against a deadline, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], *, timeout: float, what: str, every: float = 0.05) -> None:
    """Return as soon as ``condition()`` is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for: {what}")
        time.sleep(every)

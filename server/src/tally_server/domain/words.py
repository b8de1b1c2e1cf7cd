"""Words for messages people read: a count with its noun, singular for one.

The SDK and the CLI have the same helper (``tally._words``); the coordinator keeps its own because
the domain imports nothing of the SDK (importing any ``tally`` module loads the whole client, asyncio
included: see tests/unit/domain/test_purity.py).
"""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "live writer")`` → ``"1 live writer"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"

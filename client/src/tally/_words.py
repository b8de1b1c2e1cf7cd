"""Words for messages people read: a count with its noun, singular for one.

Shared by the CLI and the coordinator's refusals and logs (the server depends on this package, never
the other way round).
"""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "file")`` → ``"1 file"``.

    ``plural`` is for nouns that do not just take an ``s``: ``count(2, "entry", "entries")``. In a
    noun of several words the last one is the one made plural: ``count(2, "live writer")``.
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"

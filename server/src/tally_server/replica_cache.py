"""A replica's cache of completed ids, per checkpoint, kept under the checkpoint's ``uncompleted`` number.

The PostgreSQL store gives each checkpoint a number (``completion_checkpoints.uncompleted``, store
revision s0003) that changes whenever one of its completions goes. A replica's ``are_completed``
asks the database, in one statement (one snapshot), for the checkpoint's number now and for the
ids its cache lacks, and for the ids it has as well when that number may differ from the one the
cache was filled under (see ``replica.CompletedReader``). This module is the cache's bookkeeping
alone (no database, no clock), so that it can be checked against a model.

Why an id answered from the cache is completed in the database (never a completion it no longer holds):

1. Every id in a checkpoint's cache was seen completed by a statement that read number ``n`` in the
   same snapshot, and the cache holds it under ``n`` (ids read under another number replace the
   checkpoint's cache instead of joining it).
2. Any transaction that removes a completion of the checkpoint (DELETE, UPDATE or TRUNCATE of
   ``completed``, by Tally or anyone else) sets the checkpoint's number to ``nextval`` of a
   sequence in a trigger of its own statement: the new number commits atomically with the removal
   (a snapshot sees both or neither). A sequence never gives a value twice, and nothing else writes
   the column, so once ``n`` is replaced it never comes back (no ABA); a checkpoint deleted and made
   again gets a new number from the same sequence as its row's default.
3. A call takes the cached answers (and the number they are held under) before its statement runs,
   so the snapshots that saw them were taken before the statement's. If the statement reads the same
   ``n``, no removal committed in between (it would have replaced ``n`` for good), so every cached
   id it answers is still completed in the statement's own snapshot: the same answer as asking the
   database for it. If it reads another number, or none (the checkpoint is gone), the statement
   has looked every asked id up, and its rows alone answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Asked", "CompletedCache", "Settled"]


@dataclass(frozen=True)
class Asked:
    """What the cache knows of one call's ids, before its statement runs.

    ``number`` is the checkpoint's number the cached ids are held under (None: nothing cached), and
    ``cached[i]`` whether ``keys[i]`` is one of them. The statement looks up ``lacking`` always, and
    ``held`` too unless it reads ``number`` again.
    """

    number: int | None
    cached: list[bool]
    lacking: list[bytes]
    held: list[bytes]


@dataclass(frozen=True)
class Settled:
    """One call's answers, and what the call did to the cache (for metrics)."""

    answers: list[bool]
    hits: int  # ids answered from the cache
    dropped: bool = False  # the checkpoint's cache was dropped: its number changed, or it is gone
    evicted: int = 0  # other checkpoints evicted to make room


@dataclass
class _Entry:
    number: int
    ids: set[bytes] = field(default_factory=set)


class CompletedCache:
    """Completed ids per checkpoint, at most ``max_ids`` in all.

    Whole checkpoints are evicted, least recently asked first. Thread-safe: calls of several worker
    threads share it.

    ``max_ids`` 0: nothing is ever cached (every id is looked up).
    """

    def __init__(self, max_ids: int) -> None:
        if max_ids < 0:
            raise ValueError(f"max_ids must be 0 or more, not {max_ids}")
        self.max_ids = max_ids
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently asked first
        self._size = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Ids cached, over every checkpoint."""
        return self._size

    def checkpoints(self) -> dict[str, tuple[int, int]]:
        """Each cached checkpoint's number and how many ids it holds, least recently asked first."""
        with self._lock:
            return {name: (e.number, len(e.ids)) for name, e in self._entries.items()}

    def ask(self, checkpoint: str, keys: Sequence[bytes]) -> Asked:
        """What the cache holds of ``keys`` now (the checkpoint becomes the most recently asked)."""
        with self._lock:
            entry = self._entries.get(checkpoint)
            if entry is None:
                return Asked(None, [False] * len(keys), list(keys), [])
            self._entries.move_to_end(checkpoint)
            cached = list(map(entry.ids.__contains__, keys))
            number = entry.number
        if all(cached):  # the usual case once warm: no partition
            return Asked(number, cached, [], list(keys))
        # Duplicates are left in (the database answers each; the rows go into a set).
        lacking = [k for k, c in zip(keys, cached, strict=True) if not c]
        held = [k for k, c in zip(keys, cached, strict=True) if c]
        return Asked(number, cached, lacking, held)

    def settle(
        self, checkpoint: str, keys: Sequence[bytes], asked: Asked, number: int | None, found: set[bytes]
    ) -> Settled:
        """The answers of a call whose statement read ``number`` and found ``found`` completed.

        ``found``: the ids of ``asked.lacking`` the statement found completed, and of ``asked.held``
        too when ``number`` is not ``asked.number``. Those are added to the checkpoint's cache under
        ``number`` (None: the checkpoint has no number, nothing is cached for it).
        """
        same = number is not None and number == asked.number
        if same:
            hits = sum(asked.cached)
            if found:
                answers = [c or k in found for k, c in zip(keys, asked.cached, strict=True)]
            else:
                answers = list(asked.cached)
        else:
            answers = [k in found for k in keys]
            hits = 0
        with self._lock:
            entry = self._entries.get(checkpoint)
            dropped = asked.number is not None and not same
            if entry is not None and entry.number != number:
                # Filled under another number: dropped (stale, or older than what was just read;
                # the next call reads the number again either way).
                self._size -= len(entry.ids)
                del self._entries[checkpoint]
                entry = None
            if number is None or self.max_ids == 0:
                return Settled(answers, hits, dropped)
            if entry is None:
                entry = self._entries[checkpoint] = _Entry(number)
            self._entries.move_to_end(checkpoint)
            new = found - entry.ids
            evicted = 0
            while self._size + len(new) > self.max_ids and next(iter(self._entries)) != checkpoint:
                _, gone = self._entries.popitem(last=False)
                self._size -= len(gone.ids)
                evicted += 1
            room = self.max_ids - self._size
            if len(new) > room:  # this checkpoint alone is past the bound: only what fits
                new = set(list(new)[: max(room, 0)])
            entry.ids |= new
            self._size += len(new)
        return Settled(answers, hits, dropped, evicted)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()
            self._size = 0

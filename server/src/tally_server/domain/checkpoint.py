"""In-memory state of checkpoints and writer sessions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tally_server.domain.ledger import WriterLedger


class CompletedSet:
    """The live completed set of one checkpoint (§2.4), with a sequence number per completion.

    The sequence lets each writer see "the completed set as it stood when it opened" without
    copying it: a source counts for that writer if it was completed at or before its open sequence.
    """

    def __init__(self, initial: Iterable[str] = ()) -> None:
        self._seq = 0
        self._completed: dict[str, int] = dict.fromkeys(initial, 0)
        # Sorted UTF-8 ids for paging (export), rebuilt only after the set changed.
        self._ordered: list[bytes] | None = None

    def __contains__(self, source_id: object) -> bool:
        return source_id in self._completed

    def __len__(self) -> int:
        return len(self._completed)

    def add(self, sources: Iterable[str]) -> None:
        self._seq += 1
        self._ordered = None
        for sid in sources:
            self._completed.setdefault(sid, self._seq)

    def discard(self, source_id: str) -> bool:
        removed = self._completed.pop(source_id, None) is not None
        if removed:
            self._ordered = None
        return removed

    def in_byte_order(self) -> list[bytes]:
        """The ids as UTF-8, sorted the way LMDB orders its keys (cached until the set changes)."""
        if self._ordered is None:
            self._ordered = sorted(sid.encode() for sid in self._completed)
        return self._ordered

    def as_of_now(self) -> Callable[[str], bool]:
        """A view of the set frozen at this moment (later additions are invisible to it)."""
        cutoff = self._seq
        completed = self._completed

        def view(source_id: str) -> bool:
            seq = completed.get(source_id)
            return seq is not None and seq <= cutoff

        return view

    def sources(self) -> list[str]:
        return list(self._completed)


class WriterState:
    OPEN = "open"
    CLOSED = "closed"
    EXPIRED = "expired"
    LOST = "lost"  # was open when the coordinator stopped
    RESET = "reset"  # closed by a forced checkpoint reset


@dataclass
class WriterSession:
    handle: str
    writer_id: str
    checkpoint: str
    host: str
    pid: int
    labels: dict[str, str]
    fingerprint: dict[str, str]
    opened_at: float  # wall clock, for people
    last_seen_at: float  # wall clock
    lease_deadline: float  # monotonic
    ledger: WriterLedger
    state: str = WriterState.OPEN


@dataclass
class Checkpoint:
    name: str
    completed: CompletedSet
    created_at: float
    last_activity_at: float
    fingerprint: dict[str, str] = field(default_factory=dict)
    anomalies: int = 0
    unreadable_files: list[str] = field(default_factory=list)

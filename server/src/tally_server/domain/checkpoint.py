"""In-memory state of checkpoints and writer sessions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from tally_server.domain.ledger import WriterLedger

# Measured with tracemalloc on CPython 3.11 (1 M ids): a str object is 49 bytes plus its characters,
# its dict slot about 31; a bytes copy in the sorted list 33 plus its bytes, and 8 for the list slot.
_BYTES_PER_ID = 49 + 31
_BYTES_PER_SORTED_ID = 33 + 8


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
        self._id_chars = sum(map(len, self._completed))

    def __contains__(self, source_id: object) -> bool:
        return source_id in self._completed

    def __len__(self) -> int:
        return len(self._completed)

    def add(self, sources: Iterable[str]) -> None:
        """Mark ``sources`` completed, each under a new sequence number (ids already in keep theirs)."""
        self._seq += 1
        self._ordered = None
        completed = self._completed
        for sid in sources:
            if sid not in completed:
                completed[sid] = self._seq
                self._id_chars += len(sid)

    def discard(self, source_id: str) -> bool:
        """Drop one completion (an un-complete); returns whether the source was completed."""
        removed = self._completed.pop(source_id, None) is not None
        if removed:
            self._ordered = None
            self._id_chars -= len(source_id)
        return removed

    def estimated_bytes(self) -> int:
        """Roughly how many bytes the set holds in memory.

        Each id as a str plus its dict slot (and the sorted byte copy while an export keeps it).
        """
        size = len(self._completed) * _BYTES_PER_ID + self._id_chars
        if self._ordered is not None:
            size += len(self._ordered) * _BYTES_PER_SORTED_ID + self._id_chars
        return size

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
        """Every completed id, in the order they were completed."""
        return list(self._completed)


class WriterState(StrEnum):
    """Where a writer is in its life (the wire carries the value)."""

    OPEN = "open"
    CLOSED = "closed"  # closed by its client
    EXPIRED = "expired"  # its lease ran out
    LOST = "lost"  # was open when the coordinator stopped and could not be restored
    RESET = "reset"  # closed by a forced checkpoint reset


@dataclass
class WriterSession:
    """What the domain knows of an open writer: who it is, its lease and its ledger."""

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
    state: WriterState = WriterState.OPEN


@dataclass
class Checkpoint:
    """A known checkpoint. Its completed set is loaded on demand and may be unloaded while idle.

    While unloaded (``completed is None``) the status still answers from ``known_count``, the
    count when it was last loaded (or last sampled), so status reads never load id sets.
    """

    name: str
    created_at: float
    last_activity_at: float
    fingerprint: dict[str, str] = field(default_factory=dict)
    completed: CompletedSet | None = None
    known_count: int = 0
    anomalies: int = 0
    unreadable_files: list[str] = field(default_factory=list)
    last_used: float = 0.0  # monotonic, for least-recently-used unloading
    pins: int = 0  # operations that hold the completed set across an await

    @property
    def completed_count(self) -> int:
        """Completed sources, from the loaded set or, while unloaded, the last known count."""
        return len(self.completed) if self.completed is not None else self.known_count

    def ids(self) -> CompletedSet:
        """The loaded completed set (callers that hold a live writer or a pin)."""
        if self.completed is None:
            raise RuntimeError(f"checkpoint {self.name!r} is not loaded")
        return self.completed

    def unload(self) -> None:
        """Drop the completed set from memory, remembering its size for status reads."""
        if self.completed is not None:
            self.known_count = len(self.completed)
            self.completed = None


def choose_unloads(
    checkpoints: Iterable[Checkpoint],
    budget_bytes: int,
    *,
    busy: Callable[[Checkpoint], bool],
    used_before: float,
) -> list[Checkpoint]:
    """Which loaded checkpoints to unload so that the loaded ones fit in ``budget_bytes``.

    Least recently used first; never one that is ``busy`` (live writers, pins) or that was used at
    or after ``used_before`` (so a reader going through a big checkpoint does not make it thrash).
    """
    loaded = [cp for cp in checkpoints if cp.completed is not None]
    total = sum(cp.ids().estimated_bytes() for cp in loaded)
    chosen = []
    for cp in sorted(loaded, key=lambda c: c.last_used):
        if total <= budget_bytes:
            break
        if busy(cp) or cp.last_used >= used_before:
            continue
        chosen.append(cp)
        total -= cp.ids().estimated_bytes()
    return chosen

"""In-memory state of checkpoints and writer sessions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from tally_server.domain.completed import CompletedSet, Confirm, MergePlan
from tally_server.domain.ledger import WriterLedger

__all__ = [
    "Checkpoint",
    "Claim",
    "CompletedSet",
    "Confirm",
    "MergePlan",
    "WriterSession",
    "WriterState",
    "choose_unloads",
]


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
class Claim:
    """A live writer's claim on a source (issue #12): while it lasts, no other writer's delta for it counts.

    ``token`` is 0 while the claim is being recorded (the source is reserved, but no token is known yet).
    """

    handle: str
    writer_id: str
    token: int = 0


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
    # Sources whose cursor was saved since this coordinator started: their completion deletes it.
    # (Cursors saved before are never shown once their source is completed, and deleted when read.)
    cursored: set[str] = field(default_factory=set)
    # Failed attempts per source (issue #12's failure budgets; all in memory, failures are few) and
    # the budget: a source with ``max_attempts`` of them (0: unlimited) is failed.
    failures: dict[str, int] = field(default_factory=dict)
    max_attempts: int = 0
    # Declared sources (issue #12's totals), and a count declared when the ids are not known; how
    # many declared ones are completed (kept by the completed set while loaded; None: not known
    # since the coordinator started).
    declared: set[str] = field(default_factory=set)
    declared_count: int = 0
    known_declared_done: int | None = None
    # Live claims by source id (issue #12's claims; each ends when its source completes or its
    # writer closes or expires). Tokens of ended claims are only in the registry.
    claims: dict[str, Claim] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Declared sources; 0 when none were declared (no total is known)."""
        return max(len(self.declared), self.declared_count)

    @property
    def remaining(self) -> int:
        """Declared sources not completed; -1 when not known yet."""
        if not self.declared:
            return max(self.declared_count - self.completed_count, 0) if self.declared_count else -1
        done = self.completed.declared_done if self.completed is not None else self.known_declared_done
        return -1 if done is None else self.total - done

    @property
    def failed_count(self) -> int:
        """Sources at their failure budget (and not completed since)."""
        budget = self.max_attempts
        return sum(1 for attempts in self.failures.values() if attempts >= budget) if budget else 0

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
        if self.completed is not None and self.declared:
            self.known_declared_done = self.completed.declared_done
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

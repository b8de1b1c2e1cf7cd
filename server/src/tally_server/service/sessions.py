"""The one table of open writer sessions, by handle and by checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from tally_server.domain.checkpoint import WriterSession
from tally_server.domain.journal import Entry
from tally_server.domain.ledger import ApplyCounts
from tally_server.domain.ports import WriterRecord


@dataclass(eq=False)
class Session(WriterSession):
    """An open writer: its domain state plus the async companions that guard it.

    ``lock`` serialises the writer's batches, flushes and close; ``changed`` wakes flushes and
    closes waiting for commits; ``journal_lock`` serialises writing its journal entries.
    ``failed_commits`` counts completion commits that failed (their
    sources are re-settled and retried): a flush that saw one fail while it waited must not
    report durability.
    """

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    commits_in_flight: int = 0
    failed_commits: int = 0
    # The client's token for this session: an open retried with it attaches to this session.
    session_token: str = ""
    # The journal (DESIGN §2.1): entries not yet durable, in order; the index of the last one
    # written; one writer of the journal at a time, so entries never land out of order.
    journal_queue: list[Entry] = field(default_factory=list)
    journal_index: int = 0
    journal_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deltas_since_snapshot: int = 0
    # Sources completed whose commit is not yet confirmed durable in the journal.
    unconfirmed: set[str] = field(default_factory=set)
    # The last client batch_seq applied, and what that batch answered (a resent batch gets it again).
    applied_seq: int = 0
    last_counts: ApplyCounts = field(default_factory=ApplyCounts)
    last_refused: int = 0
    # The answers of the latest batches applied, by batch_seq: an ordered batch sent again after a
    # later one was applied gets its own answer again (memory only; a restart forgets them).
    answers: dict[int, tuple[ApplyCounts, int]] = field(default_factory=dict)
    # Sources this writer holds a claim on (their Claim is in the checkpoint's ``claims``).
    claimed: set[str] = field(default_factory=set)

    def record(self, closed_at: float | None = None) -> WriterRecord:
        """The writer's registry row (also what status shows of a live writer)."""
        t = self.ledger.totals
        return WriterRecord(
            handle=self.handle,
            checkpoint=self.checkpoint,
            writer_id=self.writer_id,
            host=self.host,
            pid=self.pid,
            labels=dict(self.labels),
            fingerprint=dict(self.fingerprint),
            state=self.state,
            opened_at=self.opened_at,
            last_seen_at=self.last_seen_at,
            closed_at=closed_at,
            pending_sources=self.ledger.in_flight,
            applied=t.applied,
            skipped=t.skipped,
            rewritten=t.rewritten,
            anomalies=t.anomalies,
            completed=t.completed,
        )

    async def notify(self) -> None:
        """Wake the flushes and closes waiting on this session."""
        async with self.changed:
            self.changed.notify_all()


class SessionTable:
    """Open sessions by handle, and by checkpoint and writer id; the two indexes never disagree."""

    def __init__(self) -> None:
        self._by_handle: dict[str, Session] = {}
        self._by_checkpoint: dict[str, dict[str, Session]] = {}

    def add(self, session: Session) -> None:
        """Add an open session to both indexes."""
        self._by_handle[session.handle] = session
        self._by_checkpoint.setdefault(session.checkpoint, {})[session.writer_id] = session

    def remove(self, session: Session) -> None:
        """Remove a session from both indexes (a no-op if another session took its place)."""
        if self._by_handle.get(session.handle) is session:
            del self._by_handle[session.handle]
        live = self._by_checkpoint.get(session.checkpoint)
        if live is not None and live.get(session.writer_id) is session:
            del live[session.writer_id]
            if not live:
                del self._by_checkpoint[session.checkpoint]

    def get(self, handle: str) -> Session | None:
        """The session with this handle, if it is in the table."""
        return self._by_handle.get(handle)

    def live(self, checkpoint: str) -> Mapping[str, Session]:
        """The checkpoint's sessions by writer id (a read-only view; copy before awaiting)."""
        return self._by_checkpoint.get(checkpoint, {})

    def __iter__(self) -> Iterator[Session]:
        """A snapshot of every session, safe to iterate across awaits."""
        return iter(list(self._by_handle.values()))

    def __len__(self) -> int:
        return len(self._by_handle)

    def pending_sources(self, checkpoint: str) -> int:
        """Sources with work in flight (settling ones excluded) across the checkpoint's writers."""
        return sum(s.ledger.in_flight for s in self.live(checkpoint).values())

    def remembered_tasks(self, checkpoint: str) -> int:
        """Task ids the checkpoint's live writers remember (each writer's dedup map), in all."""
        return sum(len(s.ledger.applied) for s in self.live(checkpoint).values())

    def settling_sources(self, checkpoint: str) -> int:
        """Sources whose settle window is running, across the checkpoint's writers."""
        return sum(len(s.ledger.settling) for s in self.live(checkpoint).values())

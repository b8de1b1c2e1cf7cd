"""A writer's journal: what it takes to bring a writer back exactly after the coordinator stops.

Every change a writer's ledger makes is an entry, appended in order and made durable before the
writer hears about it: a batch applied (with its client ``batch_seq``, so a resent batch is known),
sources completing, completions reverted after a failed commit, and now and then a snapshot of the
whole ledger that replaces the entries before it. Replaying the entries on a fresh ledger rebuilds
its pending counts and dedup map exactly (DESIGN §2.1).

What makes replay exact is that every decision the ledger takes is either a function of the
entries or recorded in them: the one outside input, the checkpoint's completed set as it stood when
the writer opened, is recorded as the sources for which it said "completed" (``hits``, each of
which made an anomaly). After the replay a writer sees the completed set as it stood when the
coordinator restarted for sources it never touched; a source another writer completed while this
one ran, and that this one first touches after the restart, is then an anomaly for it (it replays
once, nothing is falsely completed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tally_server.domain.idmap import IdMap
from tally_server.domain.ledger import ApplyCounts, Delta, LedgerState, WriterLedger


@dataclass(frozen=True)
class Opened:
    """Who the writer is: everything needed to bring its session back under the same handle."""

    handle: str
    checkpoint: str
    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    fingerprint: dict[str, str]
    opened_at: float
    session_token: str = ""


@dataclass(frozen=True)
class Applied:
    """A batch the ledger applied. ``seq`` is the client's ``batch_seq`` (0: it sent none)."""

    seq: int
    deltas: Sequence[Delta]
    hits: Sequence[str] = ()


@dataclass(frozen=True)
class Completing:
    """Sources the writer completed (journaled before their commit to the completion files)."""

    sources: Sequence[str]


@dataclass(frozen=True)
class Persisted:
    """Completions whose commit to the completion files is durable (confirms a Completing)."""

    sources: Sequence[str]


@dataclass(frozen=True)
class Reverted:
    """Completions whose commit failed: the sources settle again."""

    sources: Sequence[str]


@dataclass(frozen=True)
class Snapshot:
    """The whole ledger, replacing every entry before it."""

    state: LedgerState
    seq: int  # the last client batch_seq applied
    counts: ApplyCounts  # what that batch answered
    unconfirmed: Sequence[str] = ()  # completing, their commit not yet known durable


Entry = Applied | Completing | Persisted | Reverted | Snapshot


@dataclass
class JournaledWriter:
    """A writer as its journal has it: who it is, then its entries in order."""

    opened: Opened
    entries: list[Entry] = field(default_factory=list)
    last_index: int = 0  # the index of the last entry (new entries continue after it)


class _View:
    """The completed-before-open answers of a writer being replayed, then brought back."""

    def __init__(self, cutoff: Callable[[str], bool]) -> None:
        self._cutoff = cutoff
        self.hits: frozenset[str] | None = frozenset()  # None once the replay is over
        self.pending: IdMap | dict[str, int] = {}

    def __call__(self, source_id: str) -> bool:
        if self.hits is not None:
            return source_id in self.hits  # exactly the answers the original run got
        # A source the writer touched answered "no" when first touched (else it would be an
        # anomaly, no longer asked about); one it never touched answers as of the restart.
        return source_id not in self.pending and self._cutoff(source_id)


@dataclass
class Replayed:
    """A ledger rebuilt from its journal, and where its client left off.

    ``unconfirmed``: sources the writer completed whose commit the journal does not confirm. A
    Completing entry is journaled before its commit (so that replay sees the completion where the
    writer did), so the commit may not have happened: those the completion files lack must be
    committed again before the writer is answered.
    """

    ledger: WriterLedger
    last_seq: int
    last_counts: ApplyCounts
    unconfirmed: set[str]


def replay(entries: Sequence[Entry], cutoff: Callable[[str], bool], settle_s: float, now: float) -> Replayed:
    """Rebuild a writer's ledger from its entries.

    Args:
        entries: the writer's journal entries in order (a snapshot, if any, first).
        cutoff: the checkpoint's completed set now (what a never-touched source is answered with).
        settle_s: the settle window.
        now: the lease clock now; settle windows start over from it.
    """
    view = _View(cutoff)
    ledger = WriterLedger(view, settle_s)
    last_seq, last_counts = 0, ApplyCounts()
    unconfirmed: set[str] = set()
    for entry in entries:
        if isinstance(entry, Applied):
            view.hits = frozenset(entry.hits)
            last_counts = ledger.apply(entry.deltas, now).counts
            last_seq = entry.seq or last_seq
        elif isinstance(entry, Completing):
            unconfirmed.update(ledger.complete_settled(entry.sources))
        elif isinstance(entry, Persisted):
            unconfirmed.difference_update(entry.sources)
        elif isinstance(entry, Reverted):
            ledger.revert_completing(entry.sources, now)
            unconfirmed.difference_update(entry.sources)
        else:
            ledger.restore(entry.state, now)
            last_seq, last_counts = entry.seq, entry.counts
            unconfirmed = set(entry.unconfirmed)
    view.hits = None
    view.pending = ledger.pending
    # Sources at zero whose completion is not recorded settle again, a full window from now (a
    # window never runs out across a restart); their commit may or may not have happened, and
    # committing them again is harmless.
    ledger.settle([sid for sid, count in ledger.pending.items() if count == 0], now + settle_s)
    return Replayed(ledger, last_seq, last_counts, unconfirmed & ledger.own_completed)

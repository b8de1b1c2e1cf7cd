"""The counting rules of one writer (DESIGN §2), exactly as NeMo Curator 1.4.0's actor applies them.

Pure and synchronous: the caller passes the clock and decides when to persist. A source whose
pending count is zero at the end of a batch becomes *ready*; with ``settle_s == 0`` it is handed
back for completion at once (the anchor's behaviour), otherwise it *settles* until its deadline
and any delta for it in the meantime cancels the settle (§2.2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

Delta = tuple[str, str, int]


@dataclass
class ApplyCounts:
    """Per-call and cumulative outcome counters."""

    applied: int = 0
    skipped: int = 0
    rewritten: int = 0
    anomalies: int = 0
    completed: int = 0

    def add(self, other: ApplyCounts) -> None:
        """Add ``other``'s counters to these."""
        self.applied += other.applied
        self.skipped += other.skipped
        self.rewritten += other.rewritten
        self.anomalies += other.anomalies
        self.completed += other.completed


@dataclass(frozen=True)
class Anomaly:
    """A delta for a source already completed for this writer: the source is un-completed."""

    task_id: str
    source_id: str
    old_delta: int | None
    new_delta: int


@dataclass
class BatchResult:
    """What one batch did to a ledger: its counters, anomalies, and sources that became complete."""

    counts: ApplyCounts = field(default_factory=ApplyCounts)
    anomalies: list[Anomaly] = field(default_factory=list)
    # Sources to complete now (settle window 0); the caller persists them, then calls completed().
    complete_now: list[str] = field(default_factory=list)
    # Sources the completed-before-open view said were completed (each made an anomaly): the one
    # input of the rules from outside the batch stream, which a journal records to replay exactly.
    hits: list[str] = field(default_factory=list)


@dataclass
class LedgerState:
    """A copy of everything a ledger holds (a journal snapshot).

    Settle deadlines are not kept: a window starts over when the state is restored.
    """

    pending: dict[str, int]
    applied: dict[str, int]
    own_completed: set[str]
    uncompleted: set[str]
    settling: list[str]
    totals: ApplyCounts


class WriterLedger:
    """Pending counters, dedup map and own completions of one writer."""

    def __init__(self, completed_before_open: Callable[[str], bool], settle_s: float) -> None:
        # The checkpoint's completed set as it stood when the writer opened (§2, "completed
        # for this writer"); completions by other writers since then are not anomalies here.
        self._completed_before_open = completed_before_open
        self.settle_s = settle_s
        self.pending: dict[str, int] = {}
        self.applied: dict[str, int] = {}
        self.own_completed: set[str] = set()
        # Sources this writer un-completed through an anomaly: no longer completed for it, even if
        # they were completed before it opened (the anchor drops them from its set at once).
        self.uncompleted: set[str] = set()
        # source -> monotonic deadline after which it completes.
        self.settling: dict[str, float] = {}
        self.totals = ApplyCounts()

    @property
    def in_flight(self) -> int:
        """Sources with work in flight: pending, not counting those settling at zero.

        This is what "pending sources" means everywhere (writer and checkpoint status, metrics).
        """
        return len(self.pending) - len(self.settling)

    def is_completed(self, source_id: str) -> bool:
        """Whether the source counts as completed for this writer.

        It does if the writer completed it, or if it was completed before the writer opened and not
        un-completed since.
        """
        if source_id in self.own_completed:
            return True
        return source_id not in self.uncompleted and self._completed_before_open(source_id)

    def apply(self, batch: Iterable[Delta], now: float) -> BatchResult:
        """Apply a batch of deltas in order under the counting rules (DESIGN §2.3).

        ``now`` starts settle windows.
        """
        result = BatchResult()
        counts = result.counts
        pending, applied, settling = self.pending, self.applied, self.settling
        own_completed, uncompleted = self.own_completed, self.uncompleted
        before_open = self._completed_before_open
        many = getattr(before_open, "many", None)
        if many is not None:
            # A view that answers many ids at once (a compact index: one vectorised lookup instead
            # of one per delta) is asked once for the batch's sources.
            batch = batch if isinstance(batch, Sequence) else list(batch)
            asked = [sid for sid in dict.fromkeys(sid for _, sid, _ in batch) if sid not in own_completed]
            before_open = _answered(dict(zip(asked, many(asked), strict=True)), before_open)
        # Insertion-ordered set of sources whose count must be re-examined at the end of the batch.
        recheck: dict[str, None] = {}
        for task_id, sid, d in batch:
            if sid in settling:
                del settling[sid]  # any delta cancels the settle; re-examined below
                recheck[sid] = None
            existing = applied.get(task_id)
            if existing == d:
                counts.skipped += 1
                continue
            # self.is_completed(sid), spelled out: it runs for every delta.
            if sid in own_completed or (sid not in uncompleted and before_open(sid)):
                self._anomaly(result, task_id, sid, existing, d)
                continue
            applied[task_id] = d
            if existing is None:
                count = pending.get(sid, 0) + d
                counts.applied += 1
            else:
                count = pending.get(sid, 0) - existing + d
                counts.rewritten += 1
            pending[sid] = count
            if not count:
                recheck[sid] = None
        # The anchor completes a source that touched zero anywhere in the batch, even if a later
        # delta of the same batch moved it again (and then loses that count). Tally completes only
        # what is still at zero at the end of the batch; every other case is identical.
        for sid in recheck:
            if pending.get(sid) == 0:
                if self.settle_s <= 0:
                    result.complete_now.append(sid)
                else:
                    settling[sid] = now + self.settle_s
        self.totals.add(counts)
        return result

    def _anomaly(self, result: BatchResult, task_id: str, sid: str, old: int | None, new: int) -> None:
        result.counts.anomalies += 1
        result.anomalies.append(Anomaly(task_id, sid, old, new))
        if sid in self.own_completed:
            self.own_completed.discard(sid)
        else:
            result.hits.append(sid)  # completed before this writer opened
        self.uncompleted.add(sid)

    def due(self, now: float) -> list[str]:
        """Take the settling sources whose window has passed (they are then completing)."""
        ready = [sid for sid, deadline in self.settling.items() if deadline <= now]
        for sid in ready:
            del self.settling[sid]
        return ready

    def take_all_settling(self) -> list[str]:
        """On close: no more deltas can arrive, so every settling source completes."""
        ready = list(self.settling)
        self.settling.clear()
        return ready

    def mark_completing(self, sources: Iterable[str]) -> list[str]:
        """Record sources as completed for this writer before they are persisted.

        From here on a delta for them is an anomaly, as in the anchor. Returns the ones that
        still qualify (pending zero and not already completed), which the caller persists.
        """
        out = []
        for sid in sources:
            if self.pending.get(sid) == 0 and sid not in self.own_completed:
                self.own_completed.add(sid)
                del self.pending[sid]
                out.append(sid)
        self.totals.completed += len(out)
        return out

    def complete_settled(self, sources: Iterable[str]) -> list[str]:
        """Complete these sources now, settling or not (a journal replays when they completed)."""
        sources = list(sources)
        for sid in sources:
            self.settling.pop(sid, None)
        return self.mark_completing(sources)

    def state(self) -> LedgerState:
        """A copy of the ledger's state, for a journal snapshot."""
        t = self.totals
        return LedgerState(
            pending=dict(self.pending),
            applied=dict(self.applied),
            own_completed=set(self.own_completed),
            uncompleted=set(self.uncompleted),
            settling=list(self.settling),
            totals=ApplyCounts(t.applied, t.skipped, t.rewritten, t.anomalies, t.completed),
        )

    def restore(self, state: LedgerState, now: float) -> None:
        """Take over ``state``; its settling sources start a full window from ``now``."""
        self.pending = dict(state.pending)
        self.applied = dict(state.applied)
        self.own_completed = set(state.own_completed)
        self.uncompleted = set(state.uncompleted)
        self.settling = dict.fromkeys(state.settling, now + self.settle_s)
        t = state.totals
        self.totals = ApplyCounts(t.applied, t.skipped, t.rewritten, t.anomalies, t.completed)

    def revert_completing(self, sources: Iterable[str], now: float) -> None:
        """Persisting failed: the sources are not completed; settle them again so they are retried.

        A source un-completed meanwhile by an anomaly stays un-completed.
        """
        for sid in sources:
            if sid in self.own_completed:
                self.own_completed.discard(sid)
                self.pending[sid] = 0
                self.settling[sid] = now
                self.totals.completed -= 1


def _answered(answers: dict[str, bool], view: Callable[[str], bool]) -> Callable[[str], bool]:
    """``view`` with the answers it already gave for a batch (asked again only for the others)."""

    def before_open(source_id: str) -> bool:
        done = answers.get(source_id)
        return view(source_id) if done is None else done

    return before_open

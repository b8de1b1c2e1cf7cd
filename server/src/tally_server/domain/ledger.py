"""The counting rules of one writer (DESIGN §2), exactly as NeMo Curator 1.4.0's actor applies them.

Pure and synchronous: the caller passes the clock and decides when to persist. A source whose
pending count is zero at the end of a batch becomes *ready*; with ``settle_s == 0`` it is handed
back for completion at once (the anchor's behaviour), otherwise it *settles* until its deadline
and any delta for it in the meantime cancels the settle (§2.2).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import overload

from tally_server.domain import idmap
from tally_server.domain.idmap import IdMap, LedgerCore

Delta = tuple[str, str, int]

_COUNT = struct.Struct("<I")


def packed_strs(lengths: array[int], blob: bytes) -> bytes:
    """A column of ids as the journal stores it.

    A little-endian uint32 count, the ids' lengths as uint32s (``array("I")``, the machine's order),
    then their bytes one after the other (``blob``).
    """
    return _COUNT.pack(len(lengths)) + lengths.tobytes() + blob


def packed_ints(values: Sequence[int]) -> bytes:
    """A column of ints as the journal stores it: a little-endian uint32 count, then int64s."""
    numbers = array("q", values)
    return _COUNT.pack(len(numbers)) + numbers.tobytes()


class DeltaBatch(Sequence[Delta]):
    """A batch as three parallel columns: delta ``i`` is ``(task_ids[i], source_ids[i], values[i])``.

    It reads as a sequence of ``(task_id, source_id, delta)`` tuples, each made when read; the
    ledger and the journal read the columns instead (no tuple per delta). The columns are lists
    owned by the batch: nobody changes them.

    ``packed``: the three columns as the journal stores them (:func:`packed_strs` twice, then
    :func:`packed_ints`), made by validation when it found every id ASCII: the journal writes them
    as they are, without going through the batch again; else None.
    """

    __slots__ = ("packed", "source_ids", "task_ids", "values")

    def __init__(
        self,
        task_ids: list[str],
        source_ids: list[str],
        values: list[int],
        packed: bytes | None = None,
    ) -> None:
        self.task_ids = task_ids
        self.source_ids = source_ids
        self.values = values
        self.packed = packed

    @classmethod
    def of_rows(cls, rows: Iterable[Delta]) -> DeltaBatch:
        """The batch of these ``(task_id, source_id, delta)`` rows."""
        if isinstance(rows, DeltaBatch):
            return cls(rows.task_ids, rows.source_ids, rows.values, rows.packed)
        rows = rows if isinstance(rows, list | tuple) else list(rows)
        if not rows:
            return cls([], [], [])
        task_ids, source_ids, values = zip(*rows, strict=True)
        return cls(list(task_ids), list(source_ids), list(values))

    def __len__(self) -> int:
        return len(self.task_ids)

    def __iter__(self) -> Iterator[Delta]:
        return zip(self.task_ids, self.source_ids, self.values, strict=True)

    @overload
    def __getitem__(self, index: int) -> Delta: ...

    @overload
    def __getitem__(self, index: slice) -> DeltaBatch: ...

    def __getitem__(self, index: int | slice) -> Delta | DeltaBatch:
        if isinstance(index, slice):
            return DeltaBatch(self.task_ids[index], self.source_ids[index], self.values[index])
        return self.task_ids[index], self.source_ids[index], self.values[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeltaBatch | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


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

    pending: Mapping[str, int]
    applied: Mapping[str, int]
    own_completed: set[str]
    uncompleted: set[str]
    settling: list[str]
    totals: ApplyCounts


class WriterLedger:
    """Pending counters, dedup map and own completions of one writer.

    ``core``: the implementation of the two tables that grow with the writer's work, its pending
    counts and its dedup map (compiled or Python, domain/idmap.py); by default the server's.
    """

    def __init__(
        self, completed_before_open: Callable[[str], bool], settle_s: float, core: LedgerCore | None = None
    ) -> None:
        # The checkpoint's completed set as it stood when the writer opened (§2, "completed
        # for this writer"); completions by other writers since then are not anomalies here.
        self._completed_before_open = completed_before_open
        self.settle_s = settle_s
        self.core = core = core or idmap.current()
        self.pending: IdMap = core.new_map()
        self.applied: IdMap = core.new_map()
        self.own_completed: set[str] = set()
        # Sources this writer un-completed through an anomaly: no longer completed for it, even if
        # they were completed before it opened (the anchor drops them from its set at once).
        self.uncompleted: set[str] = set()
        # source -> deadline (lease time) after which it completes. Written through ``settle``
        # only, which keeps it in deadline order, so ``due`` need not look past the first source
        # whose window is still open.
        self.settling: dict[str, float] = {}
        self._last_deadline = float("-inf")
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
        columns = batch if isinstance(batch, DeltaBatch) else DeltaBatch.of_rows(batch)
        tasks, sources, values = columns.task_ids, columns.source_ids, columns.values
        pending, applied, settling = self.pending, self.applied, self.settling
        own_completed, uncompleted = self.own_completed, self.uncompleted
        view = self._completed_before_open
        if not uncompleted and getattr(view, "empty", False):
            # Nothing counted as completed when the writer opened (a new checkpoint), nothing
            # un-completed: a source is completed for this writer only if it completed it itself,
            # and a source leaves ``pending`` as it completes. So the core, as it counts, asks
            # ``own_completed`` about the sources not pending alone (none usually), and
            # ``settling`` about those at zero (a settling source is pending at zero): no dict of
            # the batch's sources, no lookup per source (8 % of a durable run's time). None: a task
            # not new, a source completed or settling, nothing changed; the general case then.
            zeros = self.core.apply_new(applied, pending, tasks, sources, values, own_completed, settling)
            if zeros is not None:
                result.counts.applied = len(tasks)
                return self._zeros(result, zeros, now)
        touched = dict.fromkeys(sources)
        # The batch's sources that counted as completed when the writer opened, asked once per
        # source (a view with ``many``, a compact index, answers them in one vectorised lookup).
        # Sources the writer completed or un-completed itself are not asked: the view's answer
        # does not count for them (is_completed). While a batch applies, the writer's own
        # completions only shrink, and a source leaving them is un-completed for good, so these
        # answers stay right for the whole batch.
        # (Usually the batch touches none of them: then no set is built to find out.)
        untouched = own_completed.isdisjoint(touched)
        if untouched and (not uncompleted or uncompleted.isdisjoint(touched)):
            asked = list(touched)
        else:
            asked = list(touched.keys() - own_completed - uncompleted)
        many = getattr(view, "many", None)
        before_open = set(compress(asked, many(asked) if many is not None else map(view, asked)))
        # Every task new (no skip, no rewrite) and no source completed for this writer (no anomaly)
        # or settling: the rules reduce to adding each delta to its source's count (the core's
        # apply_new, which returns None, having changed nothing, when a task is not new).
        zeros = (
            self.core.apply_new(applied, pending, tasks, sources, values, None, None)
            if not before_open and untouched and (not settling or settling.keys().isdisjoint(touched))
            else None
        )
        if zeros is not None:
            result.counts.applied = len(tasks)
        else:
            recheck = self._apply_each(result, zip(tasks, sources, values, strict=True), before_open)
            zeros = [sid for sid in recheck if pending.get(sid) == 0]
        return self._zeros(result, zeros, now)

    def _zeros(self, result: BatchResult, zeros: list[str], now: float) -> BatchResult:
        """The batch applied left ``zeros`` at zero: they complete now, or settle."""
        # The anchor completes a source that touched zero anywhere in the batch, even if a later
        # delta of the same batch moved it again (and then loses that count). Tally completes only
        # what is still at zero at the end of the batch; every other case is identical.
        if self.settle_s <= 0:
            result.complete_now = zeros
        else:
            self.settle(zeros, now + self.settle_s)
        self.totals.add(result.counts)
        return result

    def _apply_each(
        self, result: BatchResult, batch: Iterable[Delta], before_open: set[str]
    ) -> dict[str, None]:
        """The rules delta by delta; returns the sources to re-examine at the end of the batch, in order.

        ``before_open``: the batch's sources that counted as completed when the writer opened (of
        those neither completed nor un-completed by the writer itself).
        """
        pending, applied, settling = self.pending, self.applied, self.settling
        own_completed, uncompleted = self.own_completed, self.uncompleted
        recheck: dict[str, None] = {}
        skipped = applied_count = rewritten = 0
        for task_id, sid, d in batch:
            if sid in settling:
                del settling[sid]  # any delta cancels the settle; re-examined below
                recheck[sid] = None
            existing = applied.get(task_id)
            if existing == d:
                skipped += 1
                continue
            # self.is_completed(sid), spelled out: it runs for every delta.
            if sid in own_completed or (sid not in uncompleted and sid in before_open):
                self._anomaly(result, task_id, sid, existing, d)
                continue
            applied[task_id] = d
            if existing is None:
                count = pending.get(sid, 0) + d
                applied_count += 1
            else:
                count = pending.get(sid, 0) - existing + d
                rewritten += 1
            pending[sid] = count
            if not count:
                recheck[sid] = None
        counts = result.counts
        counts.skipped, counts.applied, counts.rewritten = skipped, applied_count, rewritten
        return recheck

    def _anomaly(self, result: BatchResult, task_id: str, sid: str, old: int | None, new: int) -> None:
        result.counts.anomalies += 1
        result.anomalies.append(Anomaly(task_id, sid, old, new))
        if sid in self.own_completed:
            self.own_completed.discard(sid)
        else:
            result.hits.append(sid)  # completed before this writer opened
        self.uncompleted.add(sid)

    def settle(self, sources: Sequence[str], deadline: float) -> None:
        """Let ``sources`` settle until ``deadline`` (or a later one: the latest already set).

        A window is a minimum, and lease time (the ``now`` of ``apply``, a StallClock) steps back
        when the loop is saturated, by up to the time it did not count since its last tick: taking
        the later deadline keeps ``settling`` in deadline order, which ``due`` relies on, at the
        cost of that much more waiting.
        """
        settling = self.settling
        if not settling.keys().isdisjoint(sources):  # settling already: to the end, in order
            for sid in sources:
                settling.pop(sid, None)
        self._last_deadline = deadline = max(self._last_deadline, deadline)
        settling.update(dict.fromkeys(sources, deadline))

    def due(self, now: float) -> list[str]:
        """Take the settling sources whose window has passed (they are then completing).

        ``settling`` is in deadline order (``settle``): the scan stops at the first window still
        open instead of visiting every settling source on every tick of the settle loop.
        """
        settling = self.settling
        ready = []
        for sid, deadline in settling.items():
            if deadline > now:
                break
            ready.append(sid)
        for sid in ready:
            del settling[sid]
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
        pending, own_completed = self.pending, self.own_completed
        sources = list(sources)
        if own_completed.isdisjoint(sources) and pending.take_zeros(sources):
            # All of them qualify (the common case: what a batch just brought to zero): each was
            # there once at zero, and none is in own_completed, so the set grows by all of them.
            own_completed.update(sources)
            out = sources
        else:
            out = []
            for sid in sources:
                if pending.get(sid) == 0 and sid not in own_completed:
                    own_completed.add(sid)
                    del pending[sid]
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
            pending=dict(self.pending.items()),
            applied=dict(self.applied.items()),
            own_completed=set(self.own_completed),
            uncompleted=set(self.uncompleted),
            settling=list(self.settling),
            totals=ApplyCounts(t.applied, t.skipped, t.rewritten, t.anomalies, t.completed),
        )

    def restore(self, state: LedgerState, now: float) -> None:
        """Take over ``state``; its settling sources start a full window from ``now``."""
        self.pending = self.core.copy_map(state.pending.items())
        self.applied = self.core.copy_map(state.applied.items())
        self.own_completed = set(state.own_completed)
        self.uncompleted = set(state.uncompleted)
        self.settling, self._last_deadline = {}, float("-inf")
        self.settle(state.settling, now + self.settle_s)
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
                self.settle((sid,), now)
                self.totals.completed -= 1

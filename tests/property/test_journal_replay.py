"""A writer rebuilt from its journal is the writer that was: random histories, replayed (DESIGN §2.1).

The writer is driven through the service's own steps (``domain.effects``) and journals what the
service journals, in the same places: each batch with its outside answers, completions before their
commit, confirmations and reverts after it, and now and then a snapshot. Every history is encoded
and decoded through the journal store's codec, replayed on a fresh ledger, and must give back the
same pending counts, dedup map, completions and counters; and the rebuilt writer must then take
the rest of the stream exactly as the original does.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tally_server.domain import effects
from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.journal import (
    Applied,
    Completing,
    Entry,
    Persisted,
    Reverted,
    Snapshot,
    replay,
)
from tally_server.domain.ledger import ApplyCounts, Delta, WriterLedger
from tally_server.store.journal import decode_entry, encode_entry

# The rules on each counting core: compiled (tally_server._ledgercore) and pure Python.
pytestmark = pytest.mark.usefixtures("each_ledger_core")

settings.register_profile("tally-journal", max_examples=200, derandomize=True, deadline=None, database=None)
PROFILE = settings.get_profile("tally-journal")

SOURCES = ("s0", "s1", "s2", "s3")
SETTLE_S = 4.0

bound_delta = st.builds(
    lambda sid, k, d: (f"{sid}/{k}", sid, d), st.sampled_from(SOURCES), st.integers(0, 3), st.integers(-2, 2)
)
free_delta = st.tuples(st.sampled_from(("a", "b")), st.sampled_from(SOURCES), st.integers(-2, 2))
batches = st.lists(st.one_of(bound_delta, bound_delta, free_delta), max_size=6)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("batch"), batches),
        st.tuples(st.just("resend"), st.just([])),
        st.tuples(st.just("other"), st.sampled_from(SOURCES)),  # another writer completes it
        st.tuples(st.just("tick"), st.integers(0, 8)),  # time passes; the settle loop runs
        st.tuples(st.just("fail"), st.just([])),  # the next completion commit fails
        st.tuples(st.just("snapshot"), st.just([])),
    ),
    max_size=25,
)


class Journaled:
    """A writer and its journal, kept the way the service keeps them."""

    def __init__(self, before: frozenset[str], settle_s: float) -> None:
        self.completed = CompletedSet(before)
        self.ledger = WriterLedger(self.completed.as_of_now(), settle_s)
        self.entries: list[Entry] = []
        self.seq = 0
        self.counts = ApplyCounts()
        self.unconfirmed: set[str] = set()
        self.fail_next = False

    def _commit(self, sources: list[str], now: float) -> None:
        self.entries.append(Completing(sources))
        self.unconfirmed.update(sources)
        if self.fail_next:
            self.fail_next = False
            effects.commit_failed(self.ledger, sources, now)
            self.entries.append(Reverted(sources))
            self.unconfirmed.difference_update(sources)
            return
        effects.made_durable(self.completed, sources)
        self.entries.append(Persisted(sources))
        self.unconfirmed.difference_update(sources)

    def apply(self, batch: list[Delta], seq: int, now: float) -> None:
        found = effects.apply_batch(self.ledger, self.completed, batch, now)
        self.entries.append(Applied(seq, list(batch), found.hits))
        self.seq, self.counts = seq, replace(found.counts)
        effects.uncomplete_durable(self.completed, found.uncomplete)
        if found.complete:
            self._commit(found.complete, now)

    def settle(self, now: float) -> None:
        due = effects.settle_due(self.ledger, now)
        if due:
            self._commit(due, now)

    def snapshot(self) -> None:
        self.entries.append(
            Snapshot(self.ledger.state(), self.seq, replace(self.counts), sorted(self.unconfirmed))
        )


def stored(entries: list[Entry]) -> list[Entry]:
    """The entries as the journal store gives them back (after its latest snapshot)."""
    decoded = [decode_entry(encode_entry(e)) for e in entries]
    last = max((i for i, e in enumerate(decoded) if isinstance(e, Snapshot)), default=0)
    return decoded[last:]


def same_state(a: WriterLedger, b: WriterLedger) -> None:
    assert a.pending == b.pending
    assert a.applied == b.applied
    assert a.own_completed == b.own_completed
    assert a.uncompleted == b.uncompleted
    assert set(a.settling) == set(b.settling)
    assert a.totals == b.totals


@PROFILE
@given(
    before=st.frozensets(st.sampled_from(SOURCES), max_size=2),
    history=steps,
    rest=st.lists(batches, max_size=4),
    settle=st.sampled_from((0.0, SETTLE_S)),
)
def test_a_replayed_writer_is_the_writer_that_was(
    before: frozenset[str], history: list[tuple[str, object]], rest: list[list[Delta]], settle: float
) -> None:
    writer = Journaled(before, settle)
    now, previous, seq = 0.0, [], 0
    touched: set[str] = set()
    by_others: set[str] = set()
    for kind, payload in history:
        if kind == "batch" or (kind == "resend" and previous):
            batch = payload if kind == "batch" else previous
            assert isinstance(batch, list)
            seq += 1
            writer.apply(batch, seq, now)
            touched.update(sid for _, sid, _ in batch)
            previous = batch
        elif kind == "other":
            writer.completed.add([str(payload)])
            by_others.add(str(payload))
        elif kind == "tick":
            assert isinstance(payload, int)
            now += payload
            writer.settle(now)
        elif kind == "fail":
            writer.fail_next = True
        elif kind == "snapshot":
            writer.snapshot()
    if writer.ledger.totals.anomalies:
        event("history with an anomaly")
    if any(isinstance(e, Reverted) for e in writer.entries):
        event("history with a failed commit")

    # The coordinator stops here and starts again (the completed set is what the files hold).
    files = CompletedSet(writer.completed.sources())
    rebuilt = replay(stored(writer.entries), files.as_of_now(), settle, now)
    assert rebuilt.last_seq == writer.seq
    assert rebuilt.last_counts == writer.counts
    assert rebuilt.unconfirmed == set()  # every commit here was confirmed or reverted
    assert rebuilt.ledger.pending == writer.ledger.pending
    assert rebuilt.ledger.applied == writer.ledger.applied
    assert rebuilt.ledger.own_completed == writer.ledger.own_completed
    assert rebuilt.ledger.uncompleted == writer.ledger.uncompleted
    assert rebuilt.ledger.totals == writer.ledger.totals
    # A source that was settling settles again, and so does one at zero whose completion the
    # original was still waiting for: nothing that was at zero is lost.
    zero = {sid for sid, n in writer.ledger.pending.items() if n == 0}
    assert set(rebuilt.ledger.settling) == zero

    # From here on both writers take the same deltas the same way (touched sources keep their
    # answers; the original's settle windows are let run out, as the rebuilt writer's are new).
    writer.fail_next = False  # a failure injected but not yet used would only hit the original
    writer.settle(now + 2 * SETTLE_S + 1)
    again = Journaled(before, settle)
    again.ledger, again.completed = rebuilt.ledger, files
    again.settle(now + 2 * SETTLE_S + 1)
    # (Not a source another writer completed meanwhile that this one first touches after the
    # restart: see the next test.)
    unknown = by_others - touched
    for batch in ([d for d in b if d[1] not in unknown] for b in rest):
        first = effects.apply_batch(writer.ledger, writer.completed, batch, now)
        second = effects.apply_batch(again.ledger, again.completed, batch, now)
        assert first.counts == second.counts
        assert (first.anomalies, first.complete) == (second.anomalies, second.complete)
    same_state(writer.ledger, again.ledger)


def test_a_completion_journaled_but_never_committed_is_reported_unconfirmed() -> None:
    """The one case a replay cannot settle alone: the Completing entry is durable, the commit it
    announces may not be; the service commits those again if the files lack them."""
    writer = Journaled(frozenset(), 0.0)
    found = effects.apply_batch(writer.ledger, writer.completed, [("t", "s0", 1), ("u", "s0", -1)], 0.0)
    writer.entries.append(Applied(1, [("t", "s0", 1), ("u", "s0", -1)], found.hits))
    writer.entries.append(Completing(found.complete))  # ... and the coordinator dies here
    rebuilt = replay(stored(writer.entries), CompletedSet().as_of_now(), 0.0, 0.0)
    assert rebuilt.unconfirmed == {"s0"}
    assert rebuilt.ledger.own_completed == {"s0"}


def test_a_source_another_writer_completed_meanwhile_is_an_anomaly_if_first_touched_after_restart() -> None:
    """The one thing a restart changes, documented in domain/journal.py: the journal cannot know
    what the checkpoint held when the writer opened for sources it never touched, so those are
    answered as of the restart. The effect is an anomaly (the source replays once), never a
    false completion."""
    writer = Journaled(frozenset(), 0.0)
    writer.apply([("t", "s1", 1)], 1, 0.0)
    writer.completed.add(["s0"])  # another writer completes s0 while this one runs
    live = effects.apply_batch(writer.ledger, CompletedSet(writer.completed.sources()), [("u", "s0", 1)], 0.0)
    assert live.anomalies == []  # the writer that never stopped keeps counting s0

    files = CompletedSet(writer.completed.sources())
    rebuilt = replay(stored(writer.entries), files.as_of_now(), 0.0, 0.0)
    after = effects.apply_batch(rebuilt.ledger, files, [("u", "s0", 1)], 0.0)
    assert [a.source_id for a in after.anomalies] == ["s0"]
    assert after.complete == []

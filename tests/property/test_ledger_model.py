"""Random delta streams against a small reference model of the counting rules (DESIGN §2).

The model is the anchor's ``apply_deltas`` (NeMo Curator 1.4.0) on plain dicts, with Tally's one
documented difference: a source completes only if its count is still zero at the end of the batch.
The ledger is driven through the very steps the service takes (``domain.effects``), commits made
instant, including un-completing anomalies in the checkpoint's ``CompletedSet`` and other writers
completing sources meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tally_server.domain import effects
from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.ledger import Anomaly, ApplyCounts, Delta, WriterLedger

# The rules on each counting core: compiled (tally_server._ledgercore) and pure Python.
pytestmark = pytest.mark.usefixtures("each_ledger_core")

# Quick and reproducible by default; the profile applies to this module's tests only.
settings.register_profile(
    "tally-ledger-model", max_examples=200, derandomize=True, deadline=None, database=None
)
PROFILE = settings.get_profile("tally-ledger-model")

SOURCES = ("s0", "s1", "s2")
# ("batch", deltas) | ("resend", []) | ("other", [source completed by another writer])
Step = tuple[str, list[Any]]
SETTLE_S = 4.0


# --- the reference model -----------------------------------------------------------------------


@dataclass
class Model:
    before: set[str]  # completed when the writer opened
    pending: dict[str, int] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    own: set[str] = field(default_factory=set)
    counts: ApplyCounts = field(default_factory=ApplyCounts)

    def apply(self, batch: Sequence[Delta]) -> tuple[list[str], list[Anomaly]]:
        anomalies = []
        for task, sid, d in batch:
            old = self.applied.get(task)
            if old == d:
                self.counts.skipped += 1
                continue
            if sid in self.own or sid in self.before:
                anomalies.append(Anomaly(task, sid, old, d))
                self.counts.anomalies += 1
                self.own.discard(sid)
                self.before.discard(sid)
                continue
            self.applied[task] = d
            self.pending[sid] = self.pending.get(sid, 0) + d - (old or 0)
            if old is None:
                self.counts.applied += 1
            else:
                self.counts.rewritten += 1
        done = sorted(sid for sid, n in self.pending.items() if n == 0)
        for sid in done:
            del self.pending[sid]
            self.own.add(sid)
        self.counts.completed += len(done)
        return done, anomalies


# --- driving the ledger through the service's own steps (domain.effects), commits made instant -------


@dataclass
class Writer:
    completed: CompletedSet
    ledger: WriterLedger

    @classmethod
    def open(cls, before: Iterable[str], settle_s: float) -> Writer:
        completed = CompletedSet(before)
        return cls(completed, WriterLedger(completed.as_of_now(), settle_s))

    def apply(self, batch: Sequence[Delta], now: float) -> tuple[list[str], list[Anomaly]]:
        batch_effects = effects.apply_batch(self.ledger, self.completed, batch, now)
        effects.uncomplete_durable(self.completed, batch_effects.uncomplete)
        effects.made_durable(self.completed, batch_effects.complete)
        return batch_effects.complete, batch_effects.anomalies

    def settle(self, now: float) -> list[str]:
        """The service's settle loop: sources whose window ran out complete."""
        done = effects.settle_due(self.ledger, now)
        effects.made_durable(self.completed, done)
        return done

    def close(self) -> list[str]:
        done = effects.settle_all(self.ledger)
        effects.made_durable(self.completed, done)
        return done


# --- streams ---------------------------------------------------------------------------------------

delta_values = st.integers(-2, 2)
# Task ids mostly keep to one source (as lineage ids do); some are shared across sources.
bound_delta = st.builds(
    lambda sid, k, d: (f"{sid}/{k}", sid, d), st.sampled_from(SOURCES), st.integers(0, 3), delta_values
)
free_delta = st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(SOURCES), delta_values)
batches = st.lists(st.one_of(bound_delta, bound_delta, free_delta), max_size=6)
# A step is a batch, a resend of the previous batch (client retry), or another writer completing a source.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("batch"), batches),
        st.tuples(st.just("resend"), st.just([])),
        st.tuples(st.just("other"), st.lists(st.sampled_from(SOURCES), min_size=1, max_size=1)),
    ),
    min_size=1,
    max_size=15,
)
befores = st.frozensets(st.sampled_from(SOURCES), max_size=2)
gaps = st.integers(0, 2 * int(SETTLE_S)).map(float)


def drop_anomalies(model: Model, batch: list[Delta]) -> list[Delta]:
    """The batch without the deltas that would be anomalies for ``model`` (a settle-0 run)."""
    applied, kept = dict(model.applied), []
    for task, sid, d in batch:
        if applied.get(task) != d and (sid in model.own or sid in model.before):
            continue
        applied[task] = d
        kept.append((task, sid, d))
    return kept


# --- properties --------------------------------------------------------------------------------------


@PROFILE
@given(before=befores, stream=steps)
def test_ledger_matches_reference_model_after_every_batch(before: frozenset[str], stream: list[Step]) -> None:
    model = Model(set(before))
    live = set(before)  # the checkpoint's completed set as the model sees it
    writer = Writer.open(before, settle_s=0.0)
    previous: list[Delta] = []
    for kind, payload in stream:
        if kind == "other":
            writer.completed.add(payload)
            live.update(payload)
            continue
        raw = previous if kind == "resend" else payload
        batch = raw
        previous = batch

        want_done, want_anomalies = model.apply(batch)
        done, anomalies = writer.apply(batch, 0.0)
        live.difference_update(a.source_id for a in want_anomalies)
        live.update(want_done)

        if done:
            event("batch completing a source")
        if anomalies:
            event("batch with an anomaly")
        assert sorted(done) == want_done
        assert anomalies == want_anomalies
        assert writer.ledger.pending == model.pending
        assert writer.ledger.applied == model.applied
        assert writer.ledger.own_completed == model.own
        assert writer.ledger.settling == {}
        assert set(writer.completed.sources()) == live
        assert writer.ledger.totals == model.counts
        for sid in SOURCES:
            assert writer.ledger.is_completed(sid) == (sid in model.own or sid in model.before)


@PROFILE
@given(before=befores, stream=steps, data=st.data())
def test_settle_never_completes_a_source_within_the_window_of_its_last_delta(
    before: frozenset[str], stream: list[Step], data: st.DataObject
) -> None:
    writer = Writer.open(before, settle_s=SETTLE_S)
    last_delta: dict[str, float] = {}
    now = 0.0
    previous: list[Delta] = []
    for kind, payload in [*stream, ("tick", [])]:
        now += data.draw(gaps, label="gap")
        # The service's settle loop, polling between requests.
        settling_before = dict(writer.ledger.settling)
        for sid in writer.settle(now):
            event("a source completed after its window")
            assert now - last_delta[sid] >= SETTLE_S, (sid, now, last_delta[sid])
            assert sid in settling_before
        # ... and takes every source whose window has passed.
        assert all(deadline > now for deadline in writer.ledger.settling.values())
        if kind == "other":
            writer.completed.add(payload)
        elif kind in ("batch", "resend"):
            batch = previous if kind == "resend" else payload
            previous = batch
            done, _ = writer.apply(batch, now)
            assert done == []  # with a window nothing completes inside apply
            for _, sid, _ in batch:
                last_delta[sid] = now
        for sid, deadline in writer.ledger.settling.items():
            assert writer.ledger.pending[sid] == 0
            assert deadline == last_delta[sid] + SETTLE_S


# Why (b) is restricted to streams without anomalies *in the settle-0 run*: the window exists to
# absorb a count that touches zero too early. With settle 0 that early zero completes the source,
# the late delta is an anomaly that un-completes it and is dropped, so the two runs legitimately
# end differently. E.g. batches [a:s+1] [b:s-1] [c:s+1] [d:s-1] inside one window: settle 0
# completes s, flags c as an anomaly, then counts d to -1 (s ends incomplete); the settled run
# ends with s completed. Streams where the settle-0 run has no anomaly are exactly those in which
# every delta after a settle-0 completion of its source is a retried duplicate; those the settled
# run skips too (restarting the window), so both runs end with the same counts and completions.
@PROFILE
@given(stream=steps, data=st.data())
def test_settle_ends_where_settle_zero_does_on_streams_without_anomalies(
    stream: list[Step], data: st.DataObject
) -> None:
    model = Model(set())
    instant = Writer.open((), settle_s=0.0)
    settled = Writer.open((), settle_s=SETTLE_S)
    now = 0.0
    previous: list[Delta] = []
    for kind, payload in stream:
        if kind == "other":
            continue  # other writers do not change what completes for this one
        batch = drop_anomalies(model, previous if kind == "resend" else payload)
        previous = batch
        now += data.draw(gaps, label="gap")
        settled.settle(now)

        model.apply(batch)
        _, instant_anomalies = instant.apply(batch, now)
        _, settled_anomalies = settled.apply(batch, now)
        assert instant_anomalies == []
        assert settled_anomalies == []
        # Never ahead of the settle-0 run: a completion it would not make is never visible.
        assert settled.ledger.own_completed <= instant.ledger.own_completed
        if settled.ledger.own_completed:
            event("settled run completed a source mid-stream")

    if model.own:
        event("streams completing a source")
    # Every delta is in; let the window pass.
    now += SETTLE_S
    settled.settle(now)
    assert settled.ledger.settling == {}
    assert settled.ledger.own_completed == instant.ledger.own_completed == model.own
    assert settled.ledger.pending == instant.ledger.pending == model.pending
    assert sorted(settled.completed.sources()) == sorted(instant.completed.sources())
    assert settled.ledger.totals == instant.ledger.totals == model.counts


# --- whole pipelines, shuffled ------------------------------------------------------------------------


@st.composite
def pipeline_deltas(draw: st.DrawFn, sid: str) -> tuple[list[Delta], int]:
    """The deltas NeMo Curator's stage adapter sends for one source's work tree, and how many of
    its tasks failed (each failed task keeps the source open by one)."""
    deltas: list[Delta] = [(f"0_{sid}", sid, 1)]
    failed = 0
    stack = [(f"0_{sid}", 0)]
    while stack:
        node, depth = stack.pop()
        kinds = ["sink", "filter", "fail"] + (["pass", "fanout"] * 2 if depth < 3 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "sink":
            deltas.append((f"{node}_w", sid, -1))
        elif kind == "filter":
            deltas.append((f"{node}_f", sid, -1))
        elif kind == "fail":
            deltas.append((f"{node}_x", sid, 0))
            failed += 1
        elif kind == "pass":
            deltas.append((f"{node}_0", sid, 0))
            stack.append((f"{node}_0", depth + 1))
        else:
            width = draw(st.integers(2, 3))
            lost = draw(st.integers(0, 1))  # FailedTask children of the fan-out
            continuing = width - lost
            deltas.append((f"{node}_0", sid, continuing + lost - 1))
            failed += lost
            stack.extend((f"{node}_{i}", depth + 1) for i in range(continuing))
    return deltas, failed


@PROFILE
@given(data=st.data())
def test_shuffled_pipelines_complete_exactly_the_sources_without_failures(data: st.DataObject) -> None:
    """Deltas from many workers arrive in any order and retried; within one window all is absorbed."""
    trees = {sid: data.draw(pipeline_deltas(sid), label=sid) for sid in SOURCES}
    everything = [d for deltas, _ in trees.values() for d in deltas]
    order = data.draw(st.permutations(everything), label="order")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(order)), max_size=8), label="cuts"))
    bounds = [0, *cuts, len(order)]
    sent = [order[lo:hi] for lo, hi in pairwise(bounds)]
    retries = data.draw(st.lists(st.integers(0, len(sent) - 1), max_size=3), label="retries")
    sent += [sent[i] for i in retries]

    writer = Writer.open((), settle_s=1e9)
    for now, batch in enumerate(sent):
        assert writer.apply(batch, float(now)) == ([], [])
        assert writer.settle(float(now)) == []
    done = writer.close()

    assert sorted(done) == sorted(sid for sid, (_, failed) in trees.items() if failed == 0)
    assert writer.ledger.pending == {sid: failed for sid, (_, failed) in trees.items() if failed}
    assert writer.ledger.totals == ApplyCounts(
        applied=len(everything), skipped=sum(len(sent[i]) for i in retries), completed=len(done)
    )

"""The client's model of the counting rules (``tally.replay.Rules``, used by ``tally replay``) against the
server's ledger, driven through the service's own steps, on random delta streams at settle window 0."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tally.replay import Rules
from tests.property.test_ledger_model import PROFILE, SOURCES, Step, Writer, befores, steps

# The rules on each counting core: compiled (tally_server._ledgercore) and pure Python.
pytestmark = pytest.mark.usefixtures("each_ledger_core")


@PROFILE
@given(before=befores, stream=steps)
def test_rules_complete_what_the_ledger_completes_batch_by_batch(
    before: frozenset[str], stream: list[Step]
) -> None:
    rules = Rules(before)
    writer = Writer.open(before, settle_s=0.0)
    previous: list[tuple[str, str, int]] = []
    for kind, payload in stream:
        if kind == "other":
            # Another writer completed a source after this one opened: not an anomaly for either.
            writer.completed.add(payload)
            continue
        batch = previous if kind == "resend" else payload
        previous = batch
        outcome = rules.apply(batch)
        done, anomalies = writer.apply(batch, 0.0)
        assert outcome.completed == done
        assert [(a.task_id, a.source_id, a.old_delta, a.new_delta) for a in outcome.anomalies] == [
            (a.task_id, a.source_id, a.old_delta, a.new_delta) for a in anomalies
        ]
        assert rules.pending == writer.ledger.pending
        assert rules.applied == writer.ledger.applied
        assert rules.own == writer.ledger.own_completed
        t = writer.ledger.totals
        assert rules.totals == {
            "applied": t.applied,
            "skipped": t.skipped,
            "rewritten": t.rewritten,
            "anomalies": t.anomalies,
            "completed": t.completed,
        }
        for sid in SOURCES:
            assert rules.is_completed(sid) == writer.ledger.is_completed(sid)


@PROFILE
@given(
    stream=st.lists(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(SOURCES), st.integers(-2, 2))))
)
def test_rules_on_fresh_writers_match(stream: list[list[tuple[str, str, int]]]) -> None:
    rules = Rules()
    writer = Writer.open((), settle_s=0.0)
    for batch in stream:
        assert rules.apply(batch).completed == writer.apply(batch, 0.0)[0]
    assert rules.pending == writer.ledger.pending

"""Admission, the fingerprint guard and the reset precondition (DESIGN §2.5): pure policy."""

from __future__ import annotations

import pytest

from tally_server.domain import fingerprint
from tally_server.domain.admission import admit_writer, check_reset
from tally_server.domain.checkpoint import WriterSession
from tally_server.domain.fingerprint import OnMismatch
from tally_server.domain.ledger import WriterLedger
from tally_server.domain.validation import Limits
from tally_server.errors import AlreadyExists, FailedPrecondition, PermissionDenied, ResourceExhausted


def session(writer_id: str) -> WriterSession:
    return WriterSession(
        handle=f"h-{writer_id}",
        writer_id=writer_id,
        checkpoint="cp",
        host="node-1",
        pid=42,
        labels={},
        fingerprint={},
        opened_at=0.0,
        last_seen_at=0.0,
        lease_deadline=0.0,
        ledger=WriterLedger(lambda sid: False, 0.0),
    )


def test_nothing_to_compare_is_no_mismatch() -> None:
    assert fingerprint.compare({}, {"input": "a"}) is None  # the first fingerprint gets recorded
    assert fingerprint.compare({"input": "a"}, {}) is None  # a writer without one is not checked
    assert fingerprint.compare({"input": "a"}, {"input": "a"}) is None


def test_a_mismatch_names_each_differing_component_with_both_values() -> None:
    mismatch = fingerprint.compare({"input": "a", "code": "1"}, {"input": "b", "code": "1", "extra": "x"})
    assert mismatch is not None
    assert mismatch.differing == ["extra", "input"]
    assert "extra: recorded '(absent)', this writer 'x'" in mismatch.detail
    assert "input: recorded 'a', this writer 'b'" in mismatch.detail


def test_the_decision_follows_what_the_writer_asked_and_who_it_is() -> None:
    mismatch = fingerprint.compare({"input": "a"}, {"input": "b"})
    assert mismatch is not None
    assert fingerprint.decide("cp", mismatch, OnMismatch.IGNORE, may_reset=False) is OnMismatch.IGNORE
    assert fingerprint.decide("cp", mismatch, OnMismatch.RESET, may_reset=True) is OnMismatch.RESET
    with pytest.raises(PermissionDenied, match="needs the admin role"):
        fingerprint.decide("cp", mismatch, OnMismatch.RESET, may_reset=False)
    with pytest.raises(FailedPrecondition, match="input: recorded 'a', this writer 'b'"):
        fingerprint.decide("cp", mismatch, OnMismatch.REFUSE, may_reset=True)


def test_admission_refuses_a_live_id_and_a_full_checkpoint() -> None:
    live = {"w1": session("w1")}
    admit_writer("cp", "w2", live, Limits(), 30.0)
    with pytest.raises(AlreadyExists, match="host 'node-1', pid 42"):
        admit_writer("cp", "w1", live, Limits(), 30.0)
    with pytest.raises(ResourceExhausted, match="max_writers_per_checkpoint=1"):
        admit_writer("cp", "w2", live, Limits(max_writers_per_checkpoint=1), 30.0)


def test_a_reset_needs_no_live_writers_or_force() -> None:
    check_reset("cp", {}, force=False)
    check_reset("cp", {"w1": session("w1")}, force=True)
    with pytest.raises(FailedPrecondition, match="1 live writer \\(w1\\); stop it first"):
        check_reset("cp", {"w1": session("w1")}, force=False)

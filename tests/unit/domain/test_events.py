"""Event kinds and their severity: the one table the wire, the dashboard and the CLI read."""

from __future__ import annotations

from tally_server.domain.events import EventKind, Severity, severity_of


def test_problems_have_a_severity_above_info() -> None:
    assert severity_of("unreadable_file") == severity_of("file_quarantined") == Severity.ERROR
    warnings = ["anomaly", "writer_expired", "writer_lost", "writer_reset", "checkpoint_reset"]
    assert {severity_of(k) for k in [*warnings, "fingerprint_mismatch_ignored"]} == {Severity.WARNING}
    info = ["checkpoint_created", "writer_opened", "writer_restored", "writer_closed", "imported"]
    assert {severity_of(k) for k in info} == {Severity.INFO}


def test_every_kind_has_one_and_unknown_kinds_are_info() -> None:
    assert all(kind.severity in Severity for kind in EventKind)
    assert severity_of("a_kind_from_a_newer_server") == Severity.INFO
    assert severity_of("") == Severity.INFO

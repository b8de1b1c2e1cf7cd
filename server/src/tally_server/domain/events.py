"""What the coordinator records about a checkpoint, and how much each kind of record matters."""

from __future__ import annotations

from enum import StrEnum


class Severity(StrEnum):
    """How an event should be shown: ``error`` needs someone to act, ``warning`` deserves a look."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class EventKind(StrEnum):
    """The kinds of event (the wire carries the value)."""

    CHECKPOINT_CREATED = "checkpoint_created"
    CHECKPOINT_RESET = "checkpoint_reset"
    WRITER_OPENED = "writer_opened"
    WRITER_RESTORED = "writer_restored"
    WRITER_CLOSED = "writer_closed"
    WRITER_EXPIRED = "writer_expired"
    WRITER_LOST = "writer_lost"
    WRITER_RESET = "writer_reset"
    FINGERPRINT_MISMATCH_IGNORED = "fingerprint_mismatch_ignored"
    ANOMALY = "anomaly"
    UNREADABLE_FILE = "unreadable_file"
    FILE_QUARANTINED = "file_quarantined"
    IMPORTED = "imported"
    SOURCE_FAILED = "source_failed"
    FAILURES_CLEARED = "failures_cleared"
    DELTAS_REFUSED = "deltas_refused"

    @property
    def severity(self) -> Severity:
        """How this kind of event should be shown (info unless listed otherwise)."""
        return _SEVERITY.get(self, Severity.INFO)


_SEVERITY = {
    EventKind.UNREADABLE_FILE: Severity.ERROR,
    EventKind.FILE_QUARANTINED: Severity.ERROR,
    EventKind.ANOMALY: Severity.WARNING,
    EventKind.WRITER_EXPIRED: Severity.WARNING,
    EventKind.WRITER_LOST: Severity.WARNING,
    EventKind.WRITER_RESET: Severity.WARNING,
    EventKind.CHECKPOINT_RESET: Severity.WARNING,
    EventKind.FINGERPRINT_MISMATCH_IGNORED: Severity.WARNING,
    EventKind.SOURCE_FAILED: Severity.ERROR,
    EventKind.DELTAS_REFUSED: Severity.WARNING,
}


def severity_of(kind: str) -> Severity:
    """The severity of a recorded kind (kinds unknown to this version count as info)."""
    try:
        return EventKind(kind).severity
    except ValueError:
        return Severity.INFO

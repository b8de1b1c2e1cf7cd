"""The coordinator service: the one async API both transports call.

``coordinator`` is the façade; ``sessions`` the table of open writers, ``committer`` the group
commit to the completion store, ``views`` the records it answers with, ``stats`` its counters.
"""

from tally_server.service.coordinator import CoordinatorService
from tally_server.service.stats import ServiceStats
from tally_server.service.views import (
    AppliedBatch,
    CheckpointPage,
    CheckpointView,
    ClaimView,
    ClosedWriter,
    CompletedPage,
    CursorView,
    EventPage,
    EventView,
    FailurePage,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ReplicasView,
    ReplicaView,
    ReportedFailure,
    ResetResult,
    SavedCursors,
    TokenCheck,
    WriterPage,
    WriterView,
)

__all__ = [
    "AppliedBatch",
    "CheckpointPage",
    "CheckpointView",
    "ClaimView",
    "ClosedWriter",
    "CompletedPage",
    "CursorView",
    "CoordinatorService",
    "EventPage",
    "FailurePage",
    "EventView",
    "ImportResult",
    "OpenedWriter",
    "ProgressSample",
    "ReportedFailure",
    "ReplicaView",
    "ReplicasView",
    "ResetResult",
    "SavedCursors",
    "ServiceStats",
    "TokenCheck",
    "WriterPage",
    "WriterView",
]

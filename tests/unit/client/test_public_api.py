"""The public surface of ``tally`` is pinned, and importing it stays light."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import tally

EXPECTED_ALL = [
    "AlreadyExists",
    "ApplyCounts",
    "AsyncClient",
    "AsyncWriter",
    "CheckpointStatus",
    "Claim",
    "Client",
    "ClientConfig",
    "CloseResult",
    "Event",
    "EventPage",
    "FailedAttempt",
    "FailedPrecondition",
    "FailureReport",
    "ImportResult",
    "Internal",
    "InvalidArgument",
    "LeaseLost",
    "NotFound",
    "PermissionDenied",
    "ProgressSample",
    "Replica",
    "Replicas",
    "ResetResult",
    "ResourceExhausted",
    "Severity",
    "SourceFailures",
    "StatusCode",
    "TallyError",
    "Unauthenticated",
    "Unavailable",
    "Writer",
    "WriterHealth",
    "WriterStatus",
]

# The server, Ray, and the [cli] extra (typer, rich, lmdb) are never loaded by `import tally`.
FORBIDDEN = ("tally_server", "fastapi", "ray", "sqlalchemy", "typer", "click", "rich", "lmdb")


def test_all_is_pinned_and_sorted() -> None:
    assert tally.__all__ == EXPECTED_ALL
    assert sorted(tally.__all__) == tally.__all__
    for name in tally.__all__:
        assert getattr(tally, name) is not None


def test_declared_totals_are_pinned() -> None:
    import dataclasses
    import inspect

    for cls in (tally.Client, tally.AsyncClient):
        declare = inspect.signature(cls.declare).parameters
        assert list(declare) == ["self", "checkpoint", "ids", "count"]
        assert declare["count"].kind is inspect.Parameter.KEYWORD_ONLY
        assert list(inspect.signature(cls.remaining).parameters) == ["self", "checkpoint", "page_size"]
        assert inspect.signature(cls.writer).parameters["expected_sources"].default is None
    for writer in (tally.Writer, tally.AsyncWriter):
        assert list(inspect.signature(writer.declare).parameters) == ["self", "ids", "count"]
    fields = {f.name: f.default for f in dataclasses.fields(tally.CheckpointStatus)}
    assert fields["total"] == 0 and fields["remaining"] == -1
    assert isinstance(inspect.getattr_static(tally.CheckpointStatus, "percent"), property)


def test_version() -> None:
    assert tally.__version__ == "0.1.0"
    # The distribution is tally-client (PyPI's "tally" is another project); the versions agree.
    assert importlib.metadata.version("tally-client") == tally.__version__


def test_every_exported_exception_is_a_tally_error() -> None:
    exceptions = [
        obj
        for obj in map(vars(tally).get, EXPECTED_ALL)
        if isinstance(obj, type) and issubclass(obj, Exception)
    ]
    assert len(exceptions) == 11
    assert all(issubclass(exc, tally.TallyError) for exc in exceptions)
    assert issubclass(tally.LeaseLost, tally.NotFound)


def test_import_tally_stays_light() -> None:
    # A fresh interpreter: this test process may have imported anything already.
    code = "import json, sys, tally; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    modules = json.loads(out)
    leaked = [m for m in modules if m.split(".")[0] in FORBIDDEN]
    assert leaked == []
    # The transports load lazily: a plain import needs neither grpc nor the generated stubs.
    assert "grpc" not in modules and "tally.v1" not in modules

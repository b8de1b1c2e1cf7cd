"""FailureLog: a failure that repeats is logged once per cause, a full disk once and without a traceback."""

from __future__ import annotations

import logging

import pytest

from tally_server.domain.ports import CompletionWriteError
from tally_server.logs import FailureLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def disk_full(path: str) -> CompletionWriteError:
    return CompletionWriteError(
        f"the disk holding /data is full; free space or grow the volume (cannot write {path})",
        path=path,
        disk_full=True,
    )


def raised(exc: Exception) -> Exception:
    """``exc`` with a traceback, as the commit loop catches it."""
    try:
        raise exc
    except Exception as caught:
        return caught


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> tuple[FailureLog, Clock]:
    caplog.set_level(logging.INFO, logger="test.failures")
    clock = Clock()
    return FailureLog(logging.getLogger("test.failures"), "committing completions", clock=clock), clock


def test_a_full_disk_is_one_cause_whichever_file_it_hits_and_has_no_traceback(
    log: tuple[FailureLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    failures, clock = log
    for i in range(300):  # 300 writers' files on the same full disk
        failures.failed(raised(disk_full(f"/data/w{i}.mdb")))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is None
    assert "w0.mdb" in errors[0].getMessage() and "is full" in errors[0].getMessage()
    assert failures.failing is not None and "w299.mdb" in failures.failing  # the latest cause

    clock.now = 61.0
    failures.failed(raised(disk_full("/data/w300.mdb")))
    reminder = caplog.records[-1]
    assert reminder.exc_info is None
    assert "still failing: 300 times more" in reminder.getMessage() and "w300.mdb" in reminder.getMessage()


def test_other_causes_keep_their_traceback_once_each(
    log: tuple[FailureLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    failures, _ = log
    io_error = CompletionWriteError(
        "cannot write /data/w0.mdb: Input/output error", path="/data/w0.mdb", disk_full=False
    )
    for _ in range(5):
        failures.failed(raised(io_error))
        failures.failed(raised(disk_full("/data/w0.mdb")))
        failures.failed(raised(RuntimeError("something else")))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.exc_info is not None for r in errors] == [True, False, True]
    assert "Input/output error" in errors[0].getMessage() and "something else" in errors[2].getMessage()


def test_after_a_success_a_full_disk_is_logged_again(
    log: tuple[FailureLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    failures, _ = log
    failures.failed(raised(disk_full("/data/w0.mdb")))
    failures.succeeded()
    failures.failed(raised(disk_full("/data/w1.mdb")))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["ERROR", "WARNING", "ERROR"]
    assert "works again after 1 failure" in lines[1][1]
    assert "w1.mdb" in lines[2][1]
    assert failures.failing is not None

"""`tally remaining`, and declared totals in `tally status` and `tally watch`, over the fake transport."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text
from typer.testing import CliRunner

import tally
from tally.cli.app import build_app
from tally.cli.commands import _progress_view, eta, progress_line
from tests.unit.client.tally_fakes import FakeTransport, make_client, make_status


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTransport]:
    fake = FakeTransport()
    fake.checkpoint_names.append("cp")

    def status(name: str, timeout: float) -> tally.CheckpointStatus:
        total = max(len(fake.declared), fake.declared_count)
        left = len(fake.declared - fake.completed) if fake.declared and not fake.declared_count else -1
        return dataclasses.replace(make_status(name, len(fake.completed)), total=total, remaining=left)

    fake.get_checkpoint = status  # type: ignore[method-assign]

    def factory(address: str, **kwargs: Any) -> tally.Client:
        return make_client(fake)

    monkeypatch.setattr(tally, "Client", factory)
    yield fake


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(build_app(), list(args))
    return result.exit_code, result.stdout, result.stderr


LONG_ID = "s3://bucket/" + "very-long-prefix/" * 12 + "part-00042.jsonl"


def test_remaining_prints_one_id_per_line_and_the_count_on_stderr(fake: FakeTransport) -> None:
    fake.declared = {"a", "b", "c", LONG_ID}
    fake.completed = {"b"}
    code, stdout, stderr = run("remaining", "cp")
    assert code == 0, stderr
    assert stdout.splitlines() == ["a", "c", LONG_ID]  # whole ids, nothing else: a pipe reads them
    assert "3 remaining sources of cp (of 4 declared)" in stderr

    code, stdout, stderr = run("remaining", "cp", "--limit", "2")
    assert code == 0 and stdout.splitlines() == ["a", "c"]
    assert "2 of 3 remaining sources of cp (--limit 2)" in stderr


def test_remaining_says_why_nothing_is_listed(fake: FakeTransport) -> None:
    code, stdout, stderr = run("remaining", "cp")
    assert code == 0 and stdout == "" and "no sources declared" in stderr
    fake.declared_count = 9
    code, stdout, stderr = run("remaining", "cp")
    assert code == 0 and stdout == "" and "declared as a count" in stderr


def test_status_shows_total_remaining_and_percent_only_with_a_total(fake: FakeTransport) -> None:
    code, stdout, _ = run("status", "cp")
    assert code == 0 and "total" not in stdout and "remaining" not in stdout
    fake.declared = {"a", "b", "c", "d"}
    fake.completed = {"a"}
    code, stdout, _ = run("status", "cp")
    assert code == 0
    assert "4 declared (25.0 % completed)" in stdout
    assert "3 (tally remaining cp lists them)" in stdout


def test_watch_line_has_percent_and_eta_only_with_a_total() -> None:
    plain = make_status("cp", completed=30)
    assert "ETA" not in progress_line(plain, 2.0) and "%" not in progress_line(plain, 2.0)
    assert eta(plain, 2.0) is None
    view = _progress_view(plain, 2.0)
    assert isinstance(view, Text)

    total = dataclasses.replace(plain, total=150, remaining=120)
    line = progress_line(total, 2.0)
    assert "completed 30 of 150 (20.0 %)" in line and "remaining 120" in line and "ETA 1m 0s" in line
    assert "ETA unknown" in progress_line(total, None)
    # Only a count declared: remaining read from the total.
    counted = dataclasses.replace(plain, total=40, remaining=-1)
    assert "remaining 10  ETA 5s" in progress_line(counted, 2.0)
    assert eta(dataclasses.replace(plain, total=30, remaining=0), None) == "done"
    console = Console(width=200, record=True, force_terminal=True)
    console.print(_progress_view(total, 2.0))
    drawn = console.export_text().splitlines()
    assert "━" in drawn[0] and "20.0 %  ETA 1m 0s" in drawn[0]  # the bar, with percent and ETA
    assert drawn[1].startswith("cp: completed 30 of 150")


def test_watch_once_with_a_total(fake: FakeTransport) -> None:
    fake.declared = {"a", "b"}
    fake.completed = {"a"}
    code, stdout, _ = run("watch", "cp", "--once")
    assert code == 0 and "completed 1 of 2 (50.0 %)" in stdout and "ETA unknown" in stdout

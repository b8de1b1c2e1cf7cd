"""`tally failed`, `tally retry` and the status rows of failure budgets, over the fake transport."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

import tally
from tally.cli.app import build_app
from tests.unit.client.tally_fakes import FakeTransport, make_client, make_status

LONG_ID = "s3://bucket/" + "very-long-prefix/" * 12 + "part-00042.jsonl"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTransport]:
    fake = FakeTransport()
    fake.checkpoint_names.append("cp")

    def status(name: str, timeout: float) -> tally.CheckpointStatus:
        failed = sum(fake._source_failures(s).failed for s in fake.failed_attempts)
        return dataclasses.replace(make_status(name), failed_sources=failed, max_attempts=fake.max_attempts)

    fake.get_checkpoint = status  # type: ignore[method-assign]

    def factory(address: str, **kwargs: Any) -> tally.Client:
        return make_client(fake)

    monkeypatch.setattr(tally, "Client", factory)
    yield fake


def run(*args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), list(args), input=input)
    return result.exit_code, result.output


def test_failed_lists_failed_sources_whole_with_their_latest_reasons(fake: FakeTransport) -> None:
    fake.max_attempts = 2
    fake.failed_attempts = {
        LONG_ID: ["first", "Traceback:\n  line 3\nValueError: bad row", "oom"],
        "under": ["once"],
    }
    code, output = run("failed", "cp")
    assert code == 0, output
    assert LONG_ID in output  # a pipe: never cut
    # Each reason on one line, newest first.
    assert "oom | Traceback: line 3 ValueError: bad row | first" in output
    assert "under" not in output
    assert "1 failed source in cp (max attempts 2); tally retry cp [IDS...] runs it again" in output

    code, output = run("failed", "cp", "--all")
    assert code == 0 and "under" in output and "2 sources with failed attempts" in output


def test_failed_as_json_lines(fake: FakeTransport) -> None:
    fake.max_attempts = 1
    fake.failed_attempts = {"a": ["x"], "b": ["y", "z"]}
    code, output = run("failed", "cp", "--json")
    assert code == 0
    lines = [json.loads(line) for line in output.splitlines()]
    assert [(d["source_id"], d["attempts"], [r["reason"] for r in d["recent"]]) for d in lines] == [
        ("a", 1, ["x"]),
        ("b", 2, ["y", "z"]),
    ]


def test_failed_without_a_budget_says_so(fake: FakeTransport) -> None:
    fake.failed_attempts = {"a": ["x"]}
    code, output = run("failed", "cp")
    assert code == 0 and "no source fails" in output


def test_retry_named_sources_and_all(fake: FakeTransport) -> None:
    fake.failed_attempts = {"a": ["x"], "b": ["y"], "c": ["z"]}
    code, output = run("retry", "cp", "a", "b")
    assert code == 0 and "cleared the failed attempts of 2 sources of cp" in output
    # Every source: not without --yes when stdin is no terminal (CliRunner's is not).
    code, output = run("retry", "cp")
    assert code == 1 and "--yes" in output
    assert fake.failed_attempts == {"c": ["z"]}
    code, output = run("retry", "cp", "--yes")
    assert code == 0 and "of 1 source of cp; it runs again" in output
    assert fake.args["retry_failed"] == [("cp", ("a", "b")), ("cp", ())]


def test_status_shows_failed_and_max_attempts_only_when_there_are_any(fake: FakeTransport) -> None:
    code, output = run("status", "cp")
    assert code == 0 and "max attempts" not in output
    fake.max_attempts = 2
    fake.failed_attempts = {"a": ["x", "y"]}
    code, output = run("status", "cp")
    assert code == 0
    assert "1 (tally failed cp lists them)" in output
    assert [line.split() for line in output.splitlines() if line.startswith("max attempts")] == [
        ["max", "attempts", "2"]
    ]

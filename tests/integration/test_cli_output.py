"""``-o json`` and ``-o wide`` of the listing commands: the real ``tally`` in a pipe, a real server.

``-o json`` prints one JSON document on stdout and nothing else (an array for a listing, an object
for one thing); ``-o wide`` adds the columns the default table leaves out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import tally
from tally_server.testing import RunningServer
from tests.integration.test_cli import busy, nemo_folder, ok, row, run  # noqa: F401 (fixtures)
from tests.integration.workload import tree


def as_json(*args: str, address: str | None = None) -> Any:
    """``tally ARGS -o json``: stdout parsed as one JSON document (json.loads refuses anything more)."""
    return json.loads(ok(*args, "-o", "json", address=address))


def test_status_json_is_an_array_of_checkpoints_and_one_object_with_a_name(
    server: RunningServer,
    busy: tally.Writer,  # noqa: F811
) -> None:
    tally.Client(server.grpc_address).import_completed("cli/other", ["x"], import_id="imp")
    listing = as_json("status", address=server.grpc_address)
    assert [c["name"] for c in listing] == ["cli/other", "cli/run"]  # by name
    run_ = listing[1]
    assert (run_["completed_count"], run_["pending_sources"], run_["live_writers"], run_["anomalies"]) == (
        3,
        1,
        1,
        1,
    )
    assert isinstance(run_["created_at"], float) and run_["created_at"] > 1e9
    assert run_["remaining"] == -1 and run_["total"] == 0
    assert run_["writers"] == []  # the list counts its live writer; the object below has it

    one = as_json("status", "cli/run", "--address", server.http_url)
    assert isinstance(one, dict) and one["name"] == "cli/run" and one["completed_count"] == 3
    (writer,) = one["writers"]
    assert writer["writer_id"] == "array-7" and writer["state"] == "open"
    assert writer["labels"]["slurm_job_id"] == "4242"
    assert set(writer["counts"]) == {"applied", "skipped", "rewritten", "anomalies", "completed"}
    assert (writer["counts"]["anomalies"], writer["counts"]["completed"]) == (1, 1)
    assert isinstance(writer["pid"], int) and isinstance(writer["last_seen_at"], float)


def test_status_json_with_no_checkpoints_is_an_empty_array(server: RunningServer) -> None:
    result = run("status", "-o", "json", address=server.grpc_address)
    assert result.returncode == 0 and json.loads(result.stdout) == []


def test_status_wide_adds_columns_and_keeps_the_default(
    server: RunningServer,
    busy: tally.Writer,  # noqa: F811
) -> None:
    default = ok("status", address=server.grpc_address)
    assert "settling" not in row(default, "checkpoint")
    wide = ok("status", "-o", "wide", address=server.grpc_address)
    header = row(wide, "checkpoint")
    for column in ("settling", "claimed", "max attempts", "total", "remaining", "failed", "done"):
        assert column in header, header
    for column in ("last activity at", "created at", "owner", "fingerprint"):
        assert column in header, header
    cells = dict(zip(header, row(wide, "cli/run"), strict=True))
    assert cells["completed"] == "3" and cells["max attempts"] == "unlimited" and cells["remaining"] == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", cells["created at"])

    detail = ok("status", "cli/run", "-o", "wide", address=server.grpc_address)
    assert "claimed" in detail and "max attempts" in detail
    writer = dict(zip(row(detail, "writer"), row(detail, "array-7"), strict=True))
    assert writer["anomalies"] == "1" and writer["closed at"] == "-"


def test_status_of_one_checkpoint_lists_its_first_live_writers_and_says_how_to_see_all(
    server: RunningServer,
) -> None:
    # A checkpoint of a SLURM array has hundreds of live writers: the detail lists the first 20
    # (by writer id), says on stderr how many there are, and -o json keeps every one.
    with tally.Client(server.grpc_address) as client:
        opened = [client.writer("cli/array", writer_id=f"task-{i:02d}") for i in range(23)]
        for w in opened:
            w.open()
        table = run("status", "cli/array", address=server.grpc_address)
        assert table.returncode == 0, table.stderr
        shown = re.findall(r"task-\d\d", table.stdout)
        assert shown == [f"task-{i:02d}" for i in range(20)]
        assert table.stderr.strip() == (
            "the first 20 of 23 live writers shown; tally writers cli/array --limit 23 lists them all"
        )
        wide = run("status", "cli/array", "-o", "wide", address=server.grpc_address)
        assert len(re.findall(r"task-\d\d", wide.stdout)) == 20 and "of 23 live writers" in wide.stderr
        whole = run("status", "cli/array", "-o", "json", address=server.grpc_address)
        assert len(json.loads(whole.stdout)["writers"]) == 23 and whole.stderr == ""
        opened[-1].close()
        opened[-2].close()
        opened[-3].close()
        few = run("status", "cli/array", address=server.grpc_address)
        assert len(re.findall(r"task-\d\d", few.stdout)) == 20 and few.stderr == ""


def test_writers_json_and_wide(server: RunningServer, busy: tally.Writer) -> None:  # noqa: F811
    live = as_json("writers", "cli/run", address=server.grpc_address)
    assert [w["writer_id"] for w in live] == ["array-7"]
    every = as_json("writers", "cli/run", "--all", address=server.grpc_address)
    closed = next(w for w in every if w["writer_id"] == "first")
    assert closed["state"] == "closed" and closed["closed_at"] > 0 and closed["counts"]["completed"] == 3

    wide = ok("writers", "cli/run", "--all", "-o", "wide", address=server.grpc_address)
    cells = dict(zip(row(wide, "writer"), row(wide, "first"), strict=True))
    assert cells["completions"] == "3" and cells["skipped"] == "0"
    assert re.search(r"T\d\d:\d\d:\d\d\.\d{3}", cells["closed at"]), cells
    # The default table stays as it was: no counts beyond these, no full times.
    assert "skipped" not in row(ok("writers", "cli/run", address=server.grpc_address), "writer")


def test_writers_says_when_the_limit_hides_some(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        opened = [client.writer("cli/many", writer_id=f"w{i}") for i in range(4)]
        for w in opened:
            w.open()
        capped = run("writers", "cli/many", "--limit", "3", "-o", "json", address=server.grpc_address)
        assert capped.returncode == 0, capped.stderr
        assert [w["writer_id"] for w in json.loads(capped.stdout)] == ["w0", "w1", "w2"]
        assert capped.stderr.strip() == (
            "the first 3 writers shown; there are more: tally writers cli/many --limit 30"
        )
        table = run("writers", "cli/many", "--limit", "1", address=server.grpc_address)
        assert "w0" in table.stdout and "w1" not in table.stdout
        assert "the first 1 writer shown; there are more" in table.stderr
        every = run("writers", "cli/many", "--limit", "4", address=server.grpc_address)
        assert all(f"w{i}" in every.stdout for i in range(4)) and every.stderr == ""
        for w in opened:
            w.close()


def test_events_json_pages_by_the_last_id(server: RunningServer, busy: tally.Writer) -> None:  # noqa: F811
    every = as_json("events", "cli/run", address=server.grpc_address)
    ids = [e["id"] for e in every]
    assert len(ids) >= 3 and ids == sorted(ids, reverse=True)  # newest first
    anomaly = next(e for e in every if e["kind"] == "anomaly")
    assert anomaly["severity"] == "warning" and anomaly["checkpoint"] == "cli/run"
    assert isinstance(anomaly["at"], float) and isinstance(anomaly["data"], dict)

    result = run("events", "cli/run", "--limit", "1", "-o", "json", address=server.grpc_address)
    assert result.returncode == 0
    (newest,) = json.loads(result.stdout)  # the paging hint went to stderr, not into the document
    assert newest["id"] == ids[0]
    assert f"--before {ids[0]}" in result.stderr
    older = as_json("events", "cli/run", "--before", str(ids[0]), address=server.grpc_address)
    assert [e["id"] for e in older] == ids[1:]

    warnings = as_json("events", "cli/run", "--severity", "warning", address=server.grpc_address)
    assert warnings and all(e["severity"] in ("warning", "error") for e in warnings)

    wide = ok("events", "cli/run", "-o", "wide", address=server.grpc_address)
    assert re.search(r"T\d\d:\d\d:\d\d\.\d{3}", row(wide, str(ids[0]))[1])
    assert not re.search(
        r"T\d\d:\d\d:\d\d\.\d{3}", row(ok("events", "cli/run", address=server.grpc_address), str(ids[0]))[1]
    )


def test_failed_json_is_one_array_with_every_reason(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client, client.writer("cli/fail", max_attempts=2) as w:
        for n in range(5):
            w.report_failure("s1", f"attempt {n}")
        w.report_failure("s2", "once")
    failed = as_json("failed", "cli/fail", address=server.grpc_address)
    assert [f["source_id"] for f in failed] == ["s1"] and failed[0]["failed"] is True
    assert [a["reason"] for a in failed[0]["recent"]] == [f"attempt {n}" for n in range(5)]
    every = as_json("failed", "cli/fail", "--all", address=server.grpc_address)
    assert [f["source_id"] for f in every] == ["s1", "s2"] and every[1]["failed"] is False

    wide = ok("failed", "cli/fail", "-o", "wide", address=server.grpc_address)
    reasons = row(wide, "s1")[-1]
    assert reasons == " | ".join(f"attempt {n}" for n in reversed(range(5)))  # every one, newest first
    assert "attempt 1" not in row(ok("failed", "cli/fail", address=server.grpc_address), "s1")[-1]

    both = run("failed", "cli/fail", "--json", "-o", "json", address=server.grpc_address)
    assert both.returncode == 1 and "give one of them" in both.stderr and both.stdout == ""


def test_remaining_json_is_an_array_of_ids_and_the_count_goes_to_stderr(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        client.declare("cli/left", ["a", "b", "c", "d"])
        with client.writer("cli/left") as w:
            w.apply_deltas(tree("b"))
    result = run("remaining", "cli/left", "-o", "json", address=server.grpc_address)
    assert result.returncode == 0 and sorted(json.loads(result.stdout)) == ["a", "c", "d"]
    assert "3 remaining sources of cli/left" in result.stderr
    limited = run("remaining", "cli/left", "--limit", "2", "-o", "json", address=server.grpc_address)
    assert len(json.loads(limited.stdout)) == 2 and "--limit 2" in limited.stderr


def test_replicas_json_is_one_object_for_the_store(server: RunningServer) -> None:
    found = as_json("replicas", address=server.grpc_address)
    assert found["replicas"] == [] and isinstance(found["epoch"], int) and "answered_by" in found


def test_inspect_json_and_wide(nemo_folder: Path) -> None:  # noqa: F811
    report = as_json("inspect", str(nemo_folder))
    assert report["completed_sources"] == 4
    files = {Path(f["path"]).name: f for f in report["files"]}
    assert files["host-1.mdb"]["sources"] == 3 and files["host-1.mdb"]["error"] is None
    assert files["host-3.mdb"]["sources"] is None and files["host-3.mdb"]["error"]
    wide = ok("inspect", str(nemo_folder), "-o", "wide")
    assert row(wide, str(nemo_folder / ".nemo_curator_metadata" / "host-2.mdb"))[1] == "2"


def test_in_a_pipe_long_identifiers_are_never_cut_in_any_output(server: RunningServer) -> None:
    name = "cli/" + "long-" * 46 + "end"  # 237 characters, past the 200 columns the test sets
    with tally.Client(server.grpc_address) as client, client.writer(name, writer_id="w-" + "x" * 205) as w:
        w.apply_deltas(tree("s"))
    for output in ("table", "wide"):
        listing = ok("status", "-o", output, address=server.grpc_address)
        assert row(listing, name)[1] == "1", listing
        writers = ok("writers", name, "--all", "-o", output, address=server.grpc_address)
        assert row(writers, "w-" + "x" * 205)
    assert as_json("status", address=server.grpc_address)[0]["name"] == name


def test_help_names_each_environment_variable_once() -> None:
    for command in ("status", "writers", "events", "failed", "remaining", "replicas"):
        text = run(command, "--help").stdout
        for env in ("TALLY_ADDRESS", "TALLY_TOKEN", "TALLY_TIMEOUT"):
            assert text.count(env) == 1, (command, env, text)
        assert "<table|wide|json>" in text, (command, text)

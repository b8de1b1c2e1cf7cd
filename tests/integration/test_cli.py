"""The ``tally`` operator commands as a user runs them: real subprocesses against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

import tally
from tally_server.testing import RunningServer, running_server
from tests import lmdb_damage
from tests.integration.workload import nemo_read, tree

TALLY = str(Path(sys.executable).parent / "tally")
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "7"}


def run(
    *args: str,
    address: str | None = None,
    input: str | None = None,
    timeout: float = 60,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``tally ARGS`` with a wide terminal (tables do not wrap) and a short SDK timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env.update(COLUMNS="200", TALLY_TIMEOUT="5", **(extra_env or {}))
    if address is not None:
        env["TALLY_ADDRESS"] = address
    return subprocess.run(
        [TALLY, *args], capture_output=True, text=True, env=env, input=input or "", timeout=timeout
    )


def ok(*args: str, address: str | None = None, input: str | None = None) -> str:
    result = run(*args, address=address, input=input)
    assert result.returncode == 0, f"tally {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def row(output: str, first_cell: str) -> list[str]:
    """The cells of the table row whose first cell is ``first_cell``."""
    for line in output.replace("┃", "│").splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{output}")


def value(output: str, key: str) -> str:
    """The value of ``key`` in a two-column key/value listing."""
    match = re.search(rf"^{re.escape(key)}\s{{2,}}(.*?)\s*$", output, re.MULTILINE)
    assert match, f"no {key!r} in:\n{output}"
    return match.group(1)


@pytest.fixture
def busy(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tally.Writer]:
    """Checkpoint ``cli/run``: 3 sources completed by a closed writer; a live SLURM array task with
    one more completed, one pending and one anomaly."""
    for key, val in SLURM.items():
        monkeypatch.setenv(key, val)
    client = tally.Client(server.grpc_address)
    with client.writer("cli/run", writer_id="first") as w:
        w.apply_deltas(tree("a") + tree("b") + tree("c"))
    live = client.writer("cli/run", writer_id="array-7")
    live.open()
    live.apply_deltas(tree("d") + [("0_e", "e", 1), ("0_a_late", "a", -1)])  # d done, e pending, anomaly
    live.flush()
    yield live
    try:
        live.close()
    except tally.LeaseLost:
        pass  # a test reset the checkpoint under it
    client.close()


def test_status_table_and_details(server: RunningServer, busy: tally.Writer) -> None:
    tally.Client(server.grpc_address).import_completed("cli/other", ["x"], import_id="imp")
    out = ok("status", address=server.grpc_address)
    header = row(out, "checkpoint")
    assert header == [
        "checkpoint",
        "completed",
        "pending",
        "live writers",
        "anomalies",
        "unreadable files",
        "last activity",
    ]
    cells = row(out, "cli/run")
    # a was un-completed by the anomaly: b, c and d remain.
    assert cells[1:6] == ["3", "1", "1", "1", "0"] and cells[6].endswith("ago")
    assert row(out, "cli/other")[1:3] == ["1", "0"]

    detail = ok("status", "cli/run", "--address", server.http_url)
    assert value(detail, "completed") == "3"
    assert value(detail, "pending") == "1"
    assert value(detail, "live writers") == "1"
    assert value(detail, "anomalies") == "1"
    writer = row(detail, "array-7")
    assert "slurm_job_id=4242" in writer[3] and "slurm_array_task_id=7" in writer[3]


def test_writers_table_shows_slurm_labels(server: RunningServer, busy: tally.Writer) -> None:
    out = ok("writers", "cli/run", address=server.grpc_address)
    header = row(out, "writer")
    assert header == [
        "writer",
        "host",
        "pid",
        "labels",
        "state",
        "opened",
        "heartbeat",
        "pending",
        "applied",
        "completions",
    ]
    cells = row(out, "array-7")
    assert cells[2] == str(os.getpid())
    assert cells[3] == "slurm_array_job_id=4240 slurm_array_task_id=7 slurm_job_id=4242"
    assert cells[6].endswith("ago")
    assert cells[7:] == ["1", "7", "1"]  # pending: e; applied: tree(d) and e's +1; completed: d
    assert "first" not in out

    every = ok("writers", "cli/run", "--all", address=server.grpc_address)
    first = row(every, "first")
    assert first[4] != row(every, "array-7")[4]  # closed vs live
    assert first[-1] == "3"


def test_events_page_with_before(server: RunningServer, busy: tally.Writer) -> None:
    out = ok("events", "cli/run", address=server.grpc_address)
    anomaly = next(line for line in out.splitlines() if "anomaly" in line)
    assert "source_id=a" in anomaly and "task_id=0_a_late" in anomaly and "array-7" in anomaly
    events = tally.Client(server.grpc_address).events("cli/run", limit=100).events
    ids = [e.id for e in events]

    assert ids_in(out) == ids

    first = ok("events", "cli/run", "--limit", "2", address=server.grpc_address)
    assert ids_in(first) == ids[:2]
    more = re.search(r"older events: tally events cli/run --before (\d+)", first)
    assert more and int(more.group(1)) == ids[1]
    second = ok("events", "cli/run", "--limit", "2", "--before", more.group(1), address=server.grpc_address)
    assert ids_in(second) == ids[2:4]


def test_events_show_and_filter_by_severity(server: RunningServer, busy: tally.Writer) -> None:
    busy.apply_deltas([("0_b_late", "b", -1)])  # a second anomaly (b was completed by "first")
    busy.flush()
    everything = tally.Client(server.grpc_address).events("cli/run", limit=100).events
    anomalies = [e.id for e in everything if e.kind == "anomaly"]
    assert len(anomalies) == 2 and {e.severity for e in everything if e.kind != "anomaly"} == {"info"}

    table = ok("events", "cli/run", address=server.grpc_address)
    assert row(table, str(anomalies[0]))[2:4] == ["warning", "anomaly"]
    opened = next(e.id for e in everything if e.kind == "writer_opened")
    assert row(table, str(opened))[2:4] == ["info", "writer_opened"]
    # In colour, warnings are yellow and info plain: by severity, whatever the kind is called.
    coloured = run("events", "cli/run", address=server.grpc_address, extra_env={"FORCE_COLOR": "1"}).stdout
    lines = coloured.splitlines()
    assert "\x1b[33mwarning" in next(line for line in lines if "anomaly" in line)
    assert "\x1b[" not in next(line for line in lines if "writer_opened" in line)

    warnings = ok("events", "cli/run", "--severity", "warning", address=server.grpc_address)
    assert ids_in(warnings) == anomalies and "older events" not in warnings
    # Paging keeps the filter: the hint carries it, and the last page says there is nothing older.
    first = ok("events", "cli/run", "--severity", "WARNING", "--limit", "1", address=server.grpc_address)
    assert ids_in(first) == anomalies[:1]
    hint = f"older events: tally events cli/run --before {anomalies[0]} --severity warning"
    assert hint in first
    second = ok(*hint.split()[3:], "--limit", "1", address=server.grpc_address)
    assert ids_in(second) == anomalies[1:] and "older events" not in second

    none = ok("events", "cli/run", "--severity", "error", address=server.grpc_address)
    assert none.strip() == "no events of severity error or worse in cli/run"
    assert run("events", "cli/run", "--severity", "loud", address=server.grpc_address).returncode == 2


def ids_in(output: str) -> list[int]:
    """The event ids of an events table, top to bottom (wrapped rows have an empty id cell)."""
    cells = [line.strip().strip("│").split("│")[0].strip() for line in output.splitlines()]
    return [int(c) for c in cells if c.isdigit()]


def test_export_is_a_folder_nemo_resumes_from(
    server: RunningServer, busy: tally.Writer, tmp_path: Path
) -> None:
    client = tally.Client(server.grpc_address)
    completed = set(client.completed("cli/run"))
    assert completed == {"b", "c", "d"}
    folder = tmp_path / "export"
    out = ok("export", "cli/run", str(folder), address=server.grpc_address)
    target = folder / ".nemo_curator_metadata" / "tally-export.mdb"
    assert f"exported 3 completed sources of cli/run to {target}" in out
    assert nemo_read(folder) == completed
    assert sorted(p.name for p in target.parent.iterdir()) == ["tally-export.mdb"]  # no lock file
    # NeMo Curator's exact reading: the one named database, value b"1".
    env = lmdb.open(str(target), subdir=False, readonly=True, lock=False, max_dbs=1)
    with env.begin(db=env.open_db(b"completed_sources")) as txn:
        assert {bytes(v) for _, v in txn.cursor()} == {b"1"}
    env.close()

    refused = run("export", "cli/run", str(folder), address=server.grpc_address)
    assert refused.returncode == 1 and "exists" in refused.stderr and "--overwrite" in refused.stderr
    busy.apply_deltas(tree("f"))
    busy.flush()
    ok("export", "cli/run", str(folder), "--overwrite", address=server.grpc_address)
    assert nemo_read(folder) == completed | {"f"}

    # The resume check: a fresh coordinator adopts the folder and answers exactly that set.
    with running_server(tmp_path / "fresh", settle_ms=0) as fresh:
        out = ok("import", str(folder), "--as", "restored/run", address=fresh.http_url)
        assert "imported 4 new of 4 completed sources into restored/run" in out
        assert "completed count now 4" in out
        with tally.Client(fresh.grpc_address) as restored:
            assert set(restored.completed("restored/run")) == completed | {"f"}
            assert restored.are_completed("restored/run", ["a", "b", "c", "d", "e", "f"]) == [
                False,
                True,
                True,
                True,
                False,
                True,
            ]
        again = ok("import", str(folder), "--as", "restored/run", address=fresh.grpc_address)
        assert "imported 0 new of 4" in again


def write_nemo_file(path: Path, ids: list[str]) -> None:
    env = lmdb.open(str(path), subdir=False, lock=False, max_dbs=1, map_size=1 << 20)
    db = env.open_db(b"completed_sources")
    with env.begin(write=True, db=db) as txn:
        for sid in ids:
            txn.put(sid.encode(), b"1", db=db)
    env.close()


@pytest.fixture
def nemo_folder(tmp_path: Path) -> Path:
    """A folder as NeMo Curator leaves it: two writer files that overlap, and a damaged one."""
    meta = tmp_path / "nemo" / ".nemo_curator_metadata"
    meta.mkdir(parents=True)
    write_nemo_file(meta / "host-1.mdb", ["s1", "s2", "s3"])
    write_nemo_file(meta / "host-2.mdb", ["s3", "s4"])
    (meta / "host-3.mdb").write_bytes(b"this is not an LMDB file" * 100)
    return tmp_path / "nemo"


def test_inspect_counts_and_flags_unreadable_files(nemo_folder: Path) -> None:
    for folder in (nemo_folder, nemo_folder / ".nemo_curator_metadata"):
        out = ok("inspect", str(folder))
        assert "completed sources: 4 (union of 2 readable files)" in out
        assert "files: 3, unreadable: 1" in out
        assert row(out, "host-1.mdb")[1:] == ["3", "ok"]
        assert row(out, "host-2.mdb")[1:] == ["2", "ok"]
        bad = row(out, "host-3.mdb")
        assert bad[1] == "-" and bad[2].startswith("unreadable:")
    missing = run("inspect", str(nemo_folder / "nowhere"))
    assert missing.returncode == 1 and "not a NeMo Curator checkpoint folder" in missing.stderr


def test_inspect_never_counts_a_damaged_file_lmdb_still_opens_or_a_link(
    nemo_folder: Path, tmp_path: Path
) -> None:
    meta = nemo_folder / ".nemo_curator_metadata"
    write_nemo_file(meta / "host-4.mdb", [f"many-{i:05d}" for i in range(3000)])
    lmdb_damage.damage(meta / "host-4.mdb", "main_root")  # NeMo Curator's own loader reads 0 here
    write_nemo_file(tmp_path / "outside.mdb", ["elsewhere"])
    (meta / "host-5.mdb").symlink_to(tmp_path / "outside.mdb")
    # A leaf page of the wrong type: LMDB's cursor walk would abort the whole command
    # (``Assertion 'IS_LEAF(mp)'``), so its pages are checked before anything walks them.
    write_nemo_file(meta / "host-6.mdb", [f"leaf-{i:05d}" for i in range(3000)])
    lmdb_damage.damage(meta / "host-6.mdb", "leaf")

    out = ok("inspect", str(nemo_folder))

    assert "completed sources: 4 (union of 2 readable files)" in out
    assert "files: 6, unreadable: 4" in out
    leaf = row(out, "host-6.mdb")
    assert leaf[1] == "-" and "damaged LMDB tree" in " ".join(leaf[2:]), out
    damaged = row(out, "host-4.mdb")
    assert (
        damaged[1] == "-"
        and damaged[2].startswith("unreadable: CorruptedError")
        and "MDB_CORRUPTED" in damaged[2]
    )
    link = row(out, "host-5.mdb")
    assert link[1] == "-" and "symbolic link" in link[2]


def test_import_skips_unreadable_files_with_a_warning(server: RunningServer, nemo_folder: Path) -> None:
    damaged = nemo_folder / ".nemo_curator_metadata" / "host-6.mdb"
    write_nemo_file(damaged, [f"leaf-{i:05d}" for i in range(3000)])
    lmdb_damage.damage(damaged, "leaf")  # a cursor walk would abort the command: never walked
    result = run("import", str(nemo_folder), "--as", "cli/adopted", address=server.grpc_address)
    assert result.returncode == 0, result.stderr
    assert "warning: skipping unreadable" in result.stderr and "host-3.mdb" in result.stderr
    assert "host-6.mdb" in result.stderr and "damaged LMDB tree" in result.stderr, result.stderr
    assert "imported 4 new of 4" in result.stdout
    with tally.Client(server.grpc_address) as client:
        assert sorted(client.completed("cli/adopted")) == ["s1", "s2", "s3", "s4"]
        (event,) = [e for e in client.events("cli/adopted").events if e.kind == "imported"]
        assert re.fullmatch(r"imported-\d+", event.writer_id)


def test_reset_refuses_live_writers_then_forces(server: RunningServer, busy: tally.Writer) -> None:
    refused = run("reset", "cli/run", "--yes", address=server.grpc_address)
    assert refused.returncode == 1
    # One live writer: the server's refusal and the CLI's hint speak of it in the singular.
    assert "has 1 live writer (array-7); stop it first, or force the reset" in refused.stderr, refused.stderr
    assert "its client gets NOT_FOUND) (tally reset --force does that)" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

    cancelled = run("reset", "cli/run", "--force", address=server.grpc_address, input="n\n")
    assert (
        cancelled.returncode == 1 and "Reset cli/run" in cancelled.stdout and "cancelled" in cancelled.stderr
    )
    assert "and close its 1 live writer?" in cancelled.stdout, cancelled.stdout
    with tally.Client(server.grpc_address) as client:
        assert client.are_completed("cli/run", ["b", "c", "d"]) == [True, True, True]

        out = ok("reset", "cli/run", "--force", "--yes", address=server.grpc_address)
        moved = re.search(
            r"moved 2 files to (\S+) in the server's data directory; closed 1 live writer$", out
        )
        assert moved, out
        trash = server.data_dir / moved.group(1)
        assert trash.is_relative_to(server.data_dir / ".trash")
        assert sorted(p.name for p in trash.rglob("*.mdb")) == ["array-7.mdb", "first.mdb"]
        assert client.are_completed("cli/run", ["a", "b", "c", "d", "e"]) == [False] * 5
        assert not list((server.data_dir / "checkpoints" / "cli" / "run").rglob("*.mdb"))


def test_in_a_pipe_reset_asks_for_yes_and_counts_read_right(server: RunningServer, tmp_path: Path) -> None:
    """Run as a script runs it (stdin and stdout pipes, no terminal): a question nobody can answer
    says to add --yes; one file is "1 file"; an import of nothing new writes nothing and says so."""
    with tally.Client(server.grpc_address) as client:
        with client.writer("pipe/run", writer_id="only") as w:
            w.apply_deltas(tree("a"))
        unanswered = run("reset", "pipe/run", address=server.grpc_address)  # stdin: an empty pipe
        assert unanswered.returncode == 1
        assert unanswered.stderr.strip().splitlines() == [
            "error: tally reset pipe/run asks for confirmation and got no answer: add --yes to reset "
            "without a terminal"
        ]
        assert "Aborted" not in unanswered.stdout + unanswered.stderr
        assert client.are_completed("pipe/run", ["a"]) == [True]  # nothing was reset

        out = ok("reset", "pipe/run", "--yes", address=server.grpc_address)
        assert re.fullmatch(
            r"reset pipe/run: moved 1 file to \S+ in the server's data directory; closed 0 live writers\n",
            out,
        ), out
        assert client.are_completed("pipe/run", ["a"]) == [False]
        nothing = ok("reset", "pipe/run", "--yes", address=server.grpc_address)
        assert nothing == "reset pipe/run: no files to move; closed 0 live writers\n"

    meta = tmp_path / "nemo" / ".nemo_curator_metadata"
    meta.mkdir(parents=True)
    write_nemo_file(meta / "host-1.mdb", ["s1"])
    first = ok("import", str(tmp_path / "nemo"), "--as", "pipe/imported", address=server.grpc_address)
    assert re.fullmatch(
        r"imported 1 new of 1 completed source into pipe/imported \(file imported-\d+\.mdb\); "
        r"completed count now 1\n",
        first,
    ), first
    files = sorted((server.data_dir / "checkpoints" / "pipe" / "imported").rglob("*.mdb"))
    again = ok("import", str(tmp_path / "nemo"), "--as", "pipe/imported", address=server.grpc_address)
    assert again == (
        "imported 0 new of 1 completed source into pipe/imported (nothing written: every one was "
        "completed there already); completed count now 1\n"
    )
    assert sorted((server.data_dir / "checkpoints" / "pipe" / "imported").rglob("*.mdb")) == files
    with tally.Client(server.grpc_address) as client:
        (event, *_) = client.events("pipe/imported").events
        assert event.message == "nothing imported: the one source offered was already completed"


def test_watch_prints_progress(server: RunningServer) -> None:
    client = tally.Client(server.grpc_address)
    with client.writer("cli/watched", writer_id="w") as w:
        w.apply_deltas(tree("a") + [("0_p", "p", 1)])
        w.flush()
        once = ok("watch", "cli/watched", "--once", address=server.grpc_address)
        assert "completed 1  pending 1" in once and "rate unknown" in once
        assert "ETA" not in once  # no total is known: no ETA, no bar (completed + pending is not one)

        env = {**os.environ, "COLUMNS": "200", "TALLY_ADDRESS": server.http_url}
        proc = subprocess.Popen(
            [TALLY, "watch", "cli/watched", "--max-updates", "2", "--interval", "0.05"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()
        feeder = threading.Thread(target=lambda: (w.apply_deltas(tree("b")), w.flush()))
        feeder.start()
        rest, errors = proc.communicate(timeout=60)
        feeder.join(30)
    client.close()
    assert proc.returncode == 0, errors
    lines = [first.strip(), *rest.strip().splitlines()]
    assert len(lines) == 2
    assert "cli/watched: completed 1  pending 1" in lines[0] and "rate unknown" in lines[0]
    assert "completed 2  pending 1" in lines[1] and re.search(r"rate \d+\.\d\d/s", lines[1])
    assert "ETA" not in lines[1], lines[1]


def test_sdk_errors_are_one_red_line(server: RunningServer, tmp_path: Path) -> None:
    missing = run("status", "no/such", address=server.grpc_address)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        "error: checkpoint 'no/such' does not exist" + missing.stderr.strip().split("does not exist", 1)[1]
    ]
    assert "Traceback" not in missing.stderr
    export_to = tmp_path / "export"
    for args in (["writers", "no/such"], ["events", "no/such"], ["export", "no/such", str(export_to)]):
        result = run(*args, address=server.http_url)
        assert result.returncode == 1 and result.stderr.startswith("error: "), (args, result.stderr)
    assert not export_to.exists()  # a refused export creates nothing
    down = run("status", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert down.returncode == 1 and "no Tally coordinator is listening at 127.0.0.1:1" in down.stderr
    assert "Traceback" not in down.stderr
    bad = run("status", "--address", "ftp://x")
    assert bad.returncode == 1 and "unsupported address scheme" in bad.stderr

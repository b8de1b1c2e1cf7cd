"""The registry database failing under a running coordinator (issue 7, points 3, 4 and 11).

The failure is real: another connection renames the registry's tables, so every write the
coordinator makes to them fails exactly as it would on a broken or full database, and renaming
them back is the database recovering.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tally_server.store.registry import REGISTRY_FILENAME
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

TABLES = ("writers", "events", "checkpoints")
Client = Callable[[RunningServer], httpx.Client]


@contextmanager
def registry_broken(data_dir: Path) -> Iterator[None]:
    """Every write to the writers, events and checkpoints tables fails until the block ends."""
    db = sqlite3.connect(data_dir / REGISTRY_FILENAME, timeout=10)
    try:
        for table in TABLES:
            db.execute(f"ALTER TABLE {table} RENAME TO broken_{table}")
        db.commit()
        yield
    finally:
        for table in TABLES:
            db.execute(f"ALTER TABLE broken_{table} RENAME TO {table}")
        db.commit()
        db.close()


@pytest.fixture
def stack_client() -> Iterator[Callable[[RunningServer], httpx.Client]]:
    """Makes HTTP clients for a server, closed at the end of the test."""
    with ExitStack() as stack:
        yield lambda server: stack.enter_context(httpx.Client(base_url=server.http_url, timeout=10))


def open_writer(http: httpx.Client, checkpoint: str, writer_id: str) -> httpx.Response:
    # Raw HTTP: no SDK heartbeats, so the lease runs out unless the test renews it.
    return http.post("/v1/writers", json={"checkpoint": checkpoint, "writer_id": writer_id})


def live_writers(http: httpx.Client, checkpoint: str) -> int:
    return int(http.get(f"/v1/checkpoints/{checkpoint}").json()["live_writers"])


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def loop_errors(http: httpx.Client, loop: str) -> float:
    return metric(http, f'tally_background_errors_total{{loop="{loop}"}}')


def test_leases_keep_expiring_while_the_registry_fails(tmp_path: Path, stack_client: Client) -> None:
    """Point 3: one failed registry write used to kill the lease loop, so no writer expired again."""
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=1.0) as server:
        http = stack_client(server)
        for writer_id in ("a", "b", "c"):
            assert open_writer(http, "reg/leases", writer_id).status_code == 200
        with registry_broken(server.data_dir):
            # Every expiry writes a writer row and an event: all of them fail, every writer expires.
            wait_until(
                lambda: live_writers(http, "reg/leases") == 0, timeout=20, what="all three writers expired"
            )
            wait_until(
                lambda: loop_errors(http, "registry") > 0, timeout=10, what="registry loop errors counted"
            )
            ready = http.get("/readyz")
            assert ready.status_code == 503
            assert "registry loop is failing" in ready.json()["error"]["message"]
            # A writer opened now is refused cleanly, and the next writer still expires on time.
        wait_until(lambda: http.get("/readyz").status_code == 200, timeout=20, what="ready again")
        assert open_writer(http, "reg/leases", "d").status_code == 200
        wait_until(lambda: live_writers(http, "reg/leases") == 0, timeout=20, what="writer d expired")
        # The rows that waited while the database was down were written once it came back.
        rows = http.get("/v1/writers", params={"checkpoint": "reg/leases", "include_closed": "true"}).json()
        assert sorted((w["writer_id"], w["state"]) for w in rows["writers"]) == [
            ("a", "expired"),
            ("b", "expired"),
            ("c", "expired"),
            ("d", "expired"),
        ]
        assert_no_traceback_flood(server)


def test_a_refused_open_leaves_no_live_writer_behind(tmp_path: Path, stack_client: Client) -> None:
    """Point 4: the session was registered before the registry write that then failed, so the
    writer id stayed blocked for a whole lease (ALREADY_EXISTS on the retry)."""
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=60.0) as server:
        http = stack_client(server)
        assert open_writer(http, "reg/open", "first").status_code == 200  # the checkpoint exists
        with registry_broken(server.data_dir):
            refused = open_writer(http, "reg/open", "w")
            assert refused.status_code == 503, refused.text
            body = refused.json()["error"]
            assert body["code"] == "UNAVAILABLE"
            assert "registry database" in body["message"] and "retries by itself" in body["message"]
            assert live_writers(http, "reg/open") == 1  # only "first"
        retried = open_writer(http, "reg/open", "w")
        assert retried.status_code == 200, retried.text
        handle = retried.json()["handle"]
        deltas = [{"task_id": t, "source_id": s, "delta": d} for t, s, d in tree("x")]
        assert http.post(f"/v1/writers/{handle}/deltas", json={"deltas": deltas}).status_code == 200
        assert http.post(f"/v1/writers/{handle}/close").status_code == 200
        assert http.post(
            "/v1/are-completed", json={"checkpoint": "reg/open", "source_ids": ["x"]}
        ).json() == {"completed": [True]}


def test_out_of_range_numbers_are_refused_before_the_database(tmp_path: Path, stack_client: Client) -> None:
    """Point 4: pid and before_id of 2**63 reached SQLite (OverflowError → 500)."""
    with running_server(tmp_path / "data", settle_ms=0) as server:
        http = stack_client(server)
        body = {"checkpoint": "reg/pid", "writer_id": "w", "pid": 2**63}
        refused = http.post("/v1/writers", json=body)
        assert refused.status_code == 400, refused.text
        assert "pid" in refused.json()["error"]["message"]
        assert open_writer(http, "reg/pid", "w").status_code == 200  # nothing was left behind
        page = http.get("/v1/events", params={"checkpoint": "reg/pid", "before_id": 2**63})
        assert page.status_code == 400, page.text
        assert "before_id" in page.json()["error"]["message"]
        assert "Traceback" not in server.log()


def assert_no_traceback_flood(server: RunningServer, most: int = 6) -> None:
    """Each distinct failure is logged with its traceback once, not once per retry."""
    count = server.log().count("Traceback (most recent call last)")
    assert count <= most, f"{count} tracebacks in the log:\n{server.log()[-3000:]}"

"""Status and admin operations against a real server: history across restarts, reset, import, paging."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

import tally
from tally_server.testing import running_server
from tests.integration.workload import tree


def test_progress_history_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as first, tally.Client(first.grpc_address) as client:
        with client.writer("status/history", writer_id="w") as w:
            for sid in ("a", "b", "c"):
                w.apply_deltas(tree(sid))
        assert first.terminate() == 0  # shutdown writes a final sample
    with running_server(data, settle_ms=0) as second:
        samples = httpx.get(f"{second.http_url}/v1/progress", params={"checkpoint": "status/history"}).json()
    counts = [s["completed_count"] for s in samples["samples"]]
    # A persisted sample from before the restart, then the live count appended now.
    assert counts[-1] == 3
    assert len(counts) >= 2 and counts[-2] == 3
    times = [s["at"] for s in samples["samples"]]
    assert times == sorted(times)


def test_a_new_checkpoint_has_a_baseline_sample_so_a_quick_first_run_plots_a_rise(tmp_path: Path) -> None:
    """The tour's case: a run over in a second, the dashboard opened right after. Without a sample
    taken when the checkpoint was created, the plot would be the one live point (a flat line, rate 0)
    until the first periodic sample, and then two points at the same count."""
    env = {"TALLY_PROGRESS_INTERVAL_S": "3600"}  # no periodic sample during this test
    with (
        running_server(tmp_path / "data", settle_ms=0, env=env) as server,
        tally.Client(server.grpc_address) as client,
    ):
        before = time.time()
        with client.writer("status/baseline", writer_id="w") as w:
            for sid in ("a", "b", "c"):
                w.apply_deltas(tree(sid))
        samples = client.progress("status/baseline")
        over_http = httpx.get(
            f"{server.http_url}/v1/progress", params={"checkpoint": "status/baseline"}
        ).json()
    assert [s.completed_count for s in samples] == [0, 3]  # the baseline, then the live count
    assert before - 1 < samples[0].at <= samples[1].at
    assert [s["completed_count"] for s in over_http["samples"]] == [0, 3]


def test_reset_moves_files_to_trash_and_refuses_live_writers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as server, httpx.Client(base_url=server.http_url) as http:
        with tally.Client(server.grpc_address) as client:
            with client.writer("status/reset", writer_id="live") as w:
                w.apply_deltas(tree("a"))
                w.flush()
                refused = http.post("/v1/reset", json={"name": "status/reset"})
                assert refused.status_code == 409
                assert refused.json()["error"]["code"] == "FAILED_PRECONDITION"
                message = refused.json()["error"]["message"]
                assert "'status/reset' has 1 live writer (live); stop it first, or force" in message, message
                assert "its client gets NOT_FOUND" in message, message
                with client.writer("status/reset", writer_id="other"):
                    message = http.post("/v1/reset", json={"name": "status/reset"}).json()["error"]["message"]
                    assert "has 2 live writers (live, other); stop them first" in message, message
                    assert "their clients get NOT_FOUND" in message, message
                assert client.are_completed("status/reset", ["a"]) == [True]
            moved = http.post("/v1/reset", json={"name": "status/reset"}).json()
            assert moved["files_moved"] == 1 and moved["writers_closed"] == 0
            assert client.are_completed("status/reset", ["a"]) == [False]
            trashed = data / moved["moved_to"] / ".nemo_curator_metadata" / "live.mdb"
            assert trashed.is_file()
            assert not (data / "checkpoints" / "status" / "reset" / ".nemo_curator_metadata").exists()
            kinds = [
                e["kind"]
                for e in http.get("/v1/events", params={"checkpoint": "status/reset"}).json()["events"]
            ]
            assert kinds[0] == "checkpoint_reset"
            # The checkpoint starts over: the same work completes again.
            with client.writer("status/reset", writer_id="again") as w:
                w.apply_deltas(tree("a"))
            assert client.are_completed("status/reset", ["a"]) == [True]


def test_forced_reset_closes_live_writers(tmp_path: Path) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        opened = http.post("/v1/writers", json={"checkpoint": "status/force", "writer_id": "w"}).json()
        moved = http.post("/v1/reset", json={"name": "status/force", "force": True}).json()
        assert moved["writers_closed"] == 1
        lost = http.post(f"/v1/writers/{opened['handle']}/keepalive")
        assert lost.status_code == 404
        writers = http.get(
            "/v1/writers", params={"checkpoint": "status/force", "include_closed": True}
        ).json()
        assert [(w["writer_id"], w["state"]) for w in writers["writers"]] == [("w", "reset")]


def test_import_and_completed_paging(tmp_path: Path) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        ids = [f"src-{i:03d}" for i in range(25)]
        first = http.post(
            "/v1/import", json={"checkpoint": "status/imp", "source_ids": ids[:20], "import_id": "imp-1"}
        )
        assert first.json() == {"imported": 20, "completed_count": 20}
        again = http.post(
            "/v1/import", json={"checkpoint": "status/imp", "source_ids": ids, "import_id": "imp-2"}
        )
        assert again.json() == {"imported": 5, "completed_count": 25}
        seen: list[str] = []
        after = ""
        while True:
            page = http.get(
                "/v1/completed", params={"checkpoint": "status/imp", "after": after, "limit": 10}
            ).json()
            seen += page["source_ids"]
            after = page["next_after"]
            if not after:
                break
        assert seen == ids
        bad = http.post(
            "/v1/import", json={"checkpoint": "status/imp", "source_ids": ["x"], "import_id": "../x"}
        )
        assert bad.status_code == 400
    files = sorted(
        p.name
        for p in (tmp_path / "data" / "checkpoints" / "status" / "imp" / ".nemo_curator_metadata").iterdir()
    )
    assert files == ["imp-1.mdb", "imp-2.mdb"]


def test_events_page_backwards(tmp_path: Path) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        for i in range(4):
            handle = http.post("/v1/writers", json={"checkpoint": "status/ev", "writer_id": f"w{i}"}).json()[
                "handle"
            ]
            http.post(f"/v1/writers/{handle}/close")
        ids: list[int] = []
        before = 0
        while True:
            page = http.get(
                "/v1/events", params={"checkpoint": "status/ev", "limit": 3, "before_id": before}
            ).json()
            ids += [e["id"] for e in page["events"]]
            before = page["next_before_id"]
            if not before:
                break
        assert ids == sorted(ids, reverse=True)
        assert len(ids) == 1 + 4 * 2  # created, then opened+closed per writer
        assert http.get("/v1/events", params={"checkpoint": "status/ev", "limit": 0}).status_code == 400

"""Claims with fencing tokens (issue #12): a writer acquires sources; another live writer's deltas for
them are refused (counted, recorded, never applied); a claim ends when its source completes, its writer
closes or its lease runs out, and the next claim's token is larger; a kill -9 of the coordinator keeps
both the claims of the writers it brings back and the tokens. Real ``tally serve`` processes on both
stores, spoken to over raw gRPC and HTTP: the wire contract the SDK builds on.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import running_server
from tests.integration.raw import deltas, stub
from tests.integration.workload import tree
from tests.polling import wait_until


def acquire(coordinator: pb_grpc.CoordinatorStub, handle: str, *sources: str) -> dict[str, pb.Claim]:
    answer = coordinator.Acquire(pb.AcquireRequest(handle=handle, source_ids=list(sources)))
    return {c.source_id: c for c in answer.claims}


def current(
    coordinator: pb_grpc.CoordinatorStub, checkpoint: str, source: str, token: int
) -> tuple[bool, int]:
    check = coordinator.TokenIsCurrent(
        pb.TokenIsCurrentRequest(checkpoint=checkpoint, source_id=source, token=token)
    )
    return check.current, check.live_token


def completed(coordinator: pb_grpc.CoordinatorStub, checkpoint: str, *sources: str) -> list[bool]:
    answer = coordinator.AreCompleted(pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=list(sources)))
    return list(answer.completed)


def test_claims_split_the_work_refuse_other_writers_deltas_and_survive_a_kill(
    tmp_path: Path, store: str | None
) -> None:
    data = tmp_path / "data"
    cp = "claims/run"
    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        one = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint=cp, writer_id="one")).handle
        two = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint=cp, writer_id="two")).handle
        mine = acquire(coordinator, one, "a", "b", "a")
        assert list(mine) == ["a", "b"]  # each source once, in the order asked
        assert [(c.state, c.token) for c in mine.values()] == [("acquired", 1), ("acquired", 1)]
        before = time.time()
        theirs = acquire(coordinator, two, "b", "c")
        assert (theirs["b"].state, theirs["b"].holder, theirs["b"].token) == ("held", "one", 0)
        assert theirs["b"].until > before + 20  # the holder's lease (30 s) runs out then
        assert (theirs["c"].state, theirs["c"].token) == ("acquired", 1)
        # Asking again is answered with the same token: nothing new is claimed.
        assert acquire(coordinator, one, "b")["b"].token == 1

        # "two" works on "b" anyway: its deltas are refused, never applied, and recorded.
        answer = coordinator.ApplyDeltas(
            pb.ApplyDeltasRequest(handle=two, deltas=deltas(tree("b")), batch_seq=1)
        )
        assert answer.refused == len(tree("b")) and answer.counts.applied == 0
        coordinator.Flush(pb.FlushRequest(handle=two))
        assert completed(coordinator, cp, "b") == [False]
        events = coordinator.ListEvents(pb.ListEventsRequest(checkpoint=cp)).events
        refused = [e for e in events if e.kind == "deltas_refused"]
        assert len(refused) == 1 and "b (held by one)" in refused[0].message
        assert current(coordinator, cp, "b", 1) == (True, 1)
        scrape = httpx.get(f"{server.http_url}/metrics").text
        assert f'tally_claimed_sources{{checkpoint="{cp}"}} 3.0' in scrape
        assert f"tally_deltas_refused_total {float(len(tree('b')))}" in scrape

        # "one" completes "a": its claim ends, the source is completed for everybody.
        coordinator.ApplyDeltas(pb.ApplyDeltasRequest(handle=one, deltas=deltas(tree("a")), batch_seq=1))
        coordinator.Flush(pb.FlushRequest(handle=one))
        assert acquire(coordinator, two, "a")["a"].state == "completed"
        assert current(coordinator, cp, "a", 1) == (False, 0)
        server.kill()

    with running_server(data, settle_ms=0, store=store) as again, stub(again) as coordinator:
        # Both writers came back from the journal, and "one" still holds "b".
        held = acquire(coordinator, two, "b")["b"]
        assert (held.state, held.holder) == ("held", "one")
        assert current(coordinator, cp, "b", 1) == (True, 1)
        assert current(coordinator, cp, "c", 1) == (True, 1)
        coordinator.CloseWriter(pb.CloseWriterRequest(handle=one))
        # Its claim ended with it: "two" gets "b", with a larger token; the old one is fenced off.
        taken = acquire(coordinator, two, "b")["b"]
        assert (taken.state, taken.token) == ("acquired", 2)
        assert current(coordinator, cp, "b", 1) == (False, 2)
        answer = coordinator.ApplyDeltas(
            pb.ApplyDeltasRequest(handle=two, deltas=deltas(tree("b")), batch_seq=2)
        )
        assert answer.refused == 0
        coordinator.Flush(pb.FlushRequest(handle=two))
        assert completed(coordinator, cp, "a", "b", "c") == [True, True, False]
        coordinator.CloseWriter(pb.CloseWriterRequest(handle=two))

    # Tokens only grow, also across restarts and closed writers.
    with running_server(data, settle_ms=0, store=store) as third, stub(third) as coordinator:
        three = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint=cp, writer_id="three")).handle
        claims = acquire(coordinator, three, "a", "b", "c")
        assert [(c.state, c.token) for c in claims.values()] == [
            ("completed", 0),
            ("completed", 0),
            ("acquired", 2),
        ]


def test_a_claim_ends_when_its_writers_lease_runs_out_and_failed_sources_are_not_claimed(
    tmp_path: Path,
) -> None:
    cp = "claims/lease"
    with (
        running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=1.0) as server,
        stub(server) as coordinator,
    ):
        quiet = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint=cp, writer_id="quiet")).handle
        assert acquire(coordinator, quiet, "s")["s"].token == 1
        coordinator.SetFailureBudget(pb.SetFailureBudgetRequest(checkpoint=cp, max_attempts=1))
        busy = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint=cp, writer_id="busy")).handle
        coordinator.ReportFailure(pb.ReportFailureRequest(handle=busy, source_id="bad", reason="boom"))
        assert acquire(coordinator, busy, "bad")["bad"].state == "failed"

        def taken() -> bool:
            coordinator.KeepAlive(pb.KeepAliveRequest(handle=busy))
            return acquire(coordinator, busy, "s")["s"].state == "acquired"

        # "quiet" sends nothing: once its lease runs out, its claim is free for "busy".
        wait_until(taken, timeout=30, what="the quiet writer's claim to end with its lease")
        assert acquire(coordinator, busy, "s")["s"].token == 2
        assert current(coordinator, cp, "s", 1) == (False, 2)


def test_claims_over_http_and_their_refusals(tmp_path: Path) -> None:
    tokens = {"TALLY_TOKENS": "w:worker,r:reader@claims/,a:admin"}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=tokens) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        worker, reader = ({"authorization": f"Bearer {t}"} for t in ("w", "r"))
        handle = http.post("/v1/writers", json={"checkpoint": "claims/http"}, headers=worker).json()["handle"]
        got = http.post(f"/v1/writers/{handle}/acquire", json={"source_ids": ["x", "y"]}, headers=worker)
        assert got.status_code == 200, got.text
        assert [(c["source_id"], c["state"], c["token"]) for c in got.json()["claims"]] == [
            ("x", "acquired", 1),
            ("y", "acquired", 1),
        ]
        params = {"checkpoint": "claims/http", "source_id": "x", "token": 1}
        check = http.get("/v1/claims/current", params=params, headers=reader)
        assert check.status_code == 200 and check.json() == {"current": True, "live_token": 1}
        # A reader may check tokens but not claim; bad bodies are refused, saying what was wrong.
        assert (
            http.post(f"/v1/writers/{handle}/acquire", json={"source_ids": ["z"]}, headers=reader).status_code
            == 403
        )
        empty = http.post(f"/v1/writers/{handle}/acquire", json={"source_ids": [""]}, headers=worker)
        assert empty.status_code == 400 and "source_ids[0]" in empty.json()["error"]["message"]
        missing = http.post(f"/v1/writers/{handle}/acquire", json={}, headers=worker)
        assert missing.status_code == 400 and "source_ids" in missing.json()["error"]["message"]
        unknown = http.post("/v1/writers/nope/acquire", json={"source_ids": ["z"]}, headers=worker)
        assert unknown.status_code == 404
        # Nothing was claimed by the refused calls.
        http.post(f"/v1/writers/{handle}/close", headers=worker)
        after = http.get("/v1/claims/current", params={**params, "source_id": "z"}, headers=reader)
        assert after.json() == {"current": False, "live_token": 0}
        ended = http.get("/v1/claims/current", params=params, headers=reader)
        assert ended.json() == {"current": False, "live_token": 0}  # closed: its claims ended
        nothing = http.get(
            "/v1/claims/current", params={**params, "checkpoint": "claims/none"}, headers=reader
        )
        assert nothing.status_code == 404


@pytest.mark.postgres
def test_claims_hold_through_replicas_and_the_owners_kill(tmp_path: Path, postgres_url: str) -> None:
    """Writers on two replicas of one PostgreSQL store; the owner is killed: the replica that takes
    over knows the claims of the writers it brings back, and tokens keep growing."""
    import tally

    with contextlib.ExitStack() as stack:
        owner = stack.enter_context(running_server(tmp_path / "r0", store=postgres_url, settle_ms=0))
        replica = stack.enter_context(running_server(tmp_path / "r1", store=postgres_url, settle_ms=0))
        assert "serving as a replica" in replica.log()
        addresses = f"{replica.grpc_address},{owner.grpc_address}"
        with tally.Client(addresses) as client:
            a = stack.enter_context(client.writer("claims/ha", writer_id="a"))
            b = stack.enter_context(client.writer("claims/ha", writer_id="b"))
            assert a.acquire(["s", "t"])["s"].token == 1
            assert b.acquire(["s"])["s"].state == "held"
            owner.kill()
            # Through the replica, which takes the store over: "a" still holds "s".
            held = b.acquire(["s"])["s"]
            assert (held.state, held.holder) == ("held", "a")
            assert "taking over store" in replica.log()
            assert client.token_is_current("claims/ha", "s", 1) is True
            a.apply_deltas(tree("t"))
            a.close()
            taken = b.acquire(["s", "t"])
            assert (taken["s"].state, taken["s"].token) == ("acquired", 2)
            assert taken["t"].state == "completed"
            assert client.token_is_current("claims/ha", "s", 1) is False

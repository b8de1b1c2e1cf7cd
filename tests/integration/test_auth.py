"""Tokens and roles over both transports against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1.coordinator_pb2_grpc import CoordinatorStub
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree

TOKENS = "w-secret:worker,r-secret:reader,a-secret:admin"


def test_roles_over_grpc_and_http(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", settle_ms=0, env={"TALLY_TOKENS": TOKENS}) as server:
        # A worker writes; a reader reads; nobody without a token does either.
        with tally.Client(server.grpc_address, token="w-secret") as worker:
            with worker.writer("auth/run", writer_id="w") as w:
                w.apply_deltas(tree("a"))
        for address in (server.grpc_address, server.http_url):
            with tally.Client(address, token="r-secret") as reader:
                assert reader.are_completed("auth/run", ["a"]) == [True]
                assert reader.checkpoint("auth/run").completed_count == 1
                with pytest.raises(tally.PermissionDenied, match="worker role"):
                    reader.writer("auth/run", writer_id="r").open()
                with pytest.raises(tally.PermissionDenied, match="admin role"):
                    reader.reset("auth/run", force=True)
            with tally.Client(address) as anonymous:
                with pytest.raises(tally.Unauthenticated, match="bearer token"):
                    anonymous.are_completed("auth/run", ["a"])
            with tally.Client(address, token="wrong") as stranger:
                with pytest.raises(tally.Unauthenticated, match="not known"):
                    stranger.checkpoints()
        with tally.Client(server.http_url, token="a-secret") as admin:
            assert admin.reset("auth/run").files_moved == 1
        # Probes and scrapes stay open.
        assert httpx.get(f"{server.http_url}/healthz").status_code == 200
        assert httpx.get(f"{server.http_url}/metrics").status_code == 200
        assert httpx.get(f"{server.http_url}/v1/checkpoints").status_code == 401


# --- resetting needs admin; tokens scoped to checkpoint name prefixes ---------------------------

SCOPED_TOKENS = (
    f"{TOKENS},ta-secret:worker@team-a/,tb-secret:worker@team-b/,ta-admin:admin@team-a/,"
    "tb-reader:reader@team-b/"
)
TRANSPORTS = ["grpc", "http"]


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("scoped") / "data"
    with running_server(data, settle_ms=0, env={"TALLY_TOKENS": SCOPED_TOKENS}) as server:
        yield server


def address(server: RunningServer, transport: str) -> str:
    return server.grpc_address if transport == "grpc" else server.http_url


def hundred_sources() -> list[tuple[str, str, int]]:
    return [d for i in range(100) for d in tree(f"s{i}")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_worker_cannot_reset_by_opening_with_on_mismatch_reset(
    scoped: RunningServer, transport: str
) -> None:
    checkpoint = f"escalate/{transport}"
    with tally.Client(address(scoped, transport), token="w-secret") as worker:
        with worker.writer(checkpoint, writer_id="first", fingerprint={"k": "a"}) as w:
            w.apply_deltas(hundred_sources())
        assert worker.checkpoint(checkpoint).completed_count == 100
        with pytest.raises(tally.PermissionDenied, match="resetting needs the admin role") as denied:
            worker.writer(checkpoint, writer_id="second", fingerprint={"k": "b"}, on_mismatch="reset").open()
        assert "k: recorded 'a', this writer 'b'" in str(denied.value)
        status = worker.checkpoint(checkpoint)
        assert (status.completed_count, status.live_writers, status.fingerprint) == (100, 0, {"k": "a"})
        assert "checkpoint_reset" not in [e.kind for e in worker.events(checkpoint).events]
        # The same fingerprint: nothing to reset, so a worker may ask for reset and simply resumes.
        with worker.writer(checkpoint, writer_id="same", fingerprint={"k": "a"}, on_mismatch="reset") as w:
            assert w.are_completed(["s0", "s99"]) == [True, True]
    with tally.Client(address(scoped, transport), token="a-secret") as admin:
        with admin.writer(checkpoint, writer_id="third", fingerprint={"k": "b"}, on_mismatch="reset") as w:
            assert w.are_completed(["s0"]) == [False]
        status = admin.checkpoint(checkpoint)
        assert (status.completed_count, status.fingerprint) == (0, {"k": "b"})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_scoped_admin_resets_only_under_its_prefix(scoped: RunningServer, transport: str) -> None:
    mine, theirs = f"team-a/reset-{transport}", f"team-b/reset-{transport}"
    with tally.Client(address(scoped, transport), token="a-secret") as admin:
        for checkpoint in (mine, theirs):
            with admin.writer(checkpoint, writer_id="first", fingerprint={"k": "a"}) as w:
                w.apply_deltas(tree("x"))
    with tally.Client(address(scoped, transport), token="ta-admin") as team_admin:
        with pytest.raises(tally.PermissionDenied, match="'team-a/'"):
            team_admin.writer(theirs, writer_id="w", fingerprint={"k": "b"}, on_mismatch="reset").open()
        with pytest.raises(tally.PermissionDenied, match="'team-a/'"):
            team_admin.reset(theirs)
        with team_admin.writer(mine, writer_id="w", fingerprint={"k": "b"}, on_mismatch="reset") as w:
            assert w.are_completed(["x"]) == [False]
    with tally.Client(address(scoped, transport), token="r-secret") as reader:
        assert reader.checkpoint(theirs).completed_count == 1
        assert reader.checkpoint(mine).completed_count == 0


def raw_open(server: RunningServer, transport: str, token: str, checkpoint: str) -> str:
    """Open a writer with raw calls, to learn its handle (the SDK keeps it to itself)."""
    if transport == "grpc":
        with grpc.insecure_channel(server.grpc_address) as channel:
            reply = CoordinatorStub(channel).OpenWriter(
                pb.OpenWriterRequest(checkpoint=checkpoint, writer_id="raw"), metadata=bearer(token)
            )
            return str(reply.handle)
    response = httpx.post(
        f"{server.http_url}/v1/writers",
        json={"checkpoint": checkpoint, "writer_id": "raw"},
        headers={"authorization": f"Bearer {token}"},
    )
    response.raise_for_status()
    return str(response.json()["handle"])


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def raw_writer_call(server: RunningServer, transport: str, token: str, action: str, handle: str) -> str:
    """KeepAlive, ApplyDeltas (rows or columns), Flush or CloseWriter on ``handle``: the status's name."""
    deltas = [("0_x", "x", 5)]  # a changed delta for a completed source: an anomaly that un-completes
    if transport == "grpc":
        requests = {
            "keepalive": ("KeepAlive", pb.KeepAliveRequest(handle=handle)),
            "deltas": (
                "ApplyDeltas",
                pb.ApplyDeltasRequest(
                    handle=handle, deltas=[pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in deltas]
                ),
            ),
            # The batch as columns: read from the request's bytes by the compiled core, checked all the same.
            "columns": (
                "ApplyDeltas",
                pb.ApplyDeltasRequest(
                    handle=handle,
                    columns=pb.DeltaColumns(
                        task_ids=[t for t, _, _ in deltas],
                        source_ids=[s for _, s, _ in deltas],
                        deltas=[d for _, _, d in deltas],
                    ),
                ),
            ),
            "flush": ("Flush", pb.FlushRequest(handle=handle)),
            "close": ("CloseWriter", pb.CloseWriterRequest(handle=handle)),
        }
        method, request = requests[action]
        with grpc.insecure_channel(server.grpc_address) as channel:
            try:
                getattr(CoordinatorStub(channel), method)(request, metadata=bearer(token))
            except grpc.RpcError as err:
                return str(err.code().name)  # type: ignore[attr-defined]
            return "OK"
    rows = {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in deltas]}
    columns = {"columns": {"task_ids": ["0_x"], "source_ids": ["x"], "deltas": [5]}}
    body = {"deltas": rows, "columns": columns}.get(action, {})
    response = httpx.post(
        f"{server.http_url}/v1/writers/{handle}/{'deltas' if action == 'columns' else action}",
        json=body,
        headers={"authorization": f"Bearer {token}"},
    )
    return "OK" if response.is_success else str(response.json()["error"]["code"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_team_a_cannot_complete_or_uncomplete_team_b_sources(scoped: RunningServer, transport: str) -> None:
    theirs, mine = f"team-b/run-{transport}", f"team-a/run-{transport}"
    # Team B completes x with a writer that stays open; its handle is what team A would abuse.
    handle = raw_open(scoped, transport, "tb-secret", theirs)
    assert raw_writer_call(scoped, transport, "tb-secret", "keepalive", handle) == "OK"
    with tally.Client(address(scoped, transport), token="tb-secret") as team_b:
        with team_b.writer(theirs, writer_id="b1") as w:
            w.apply_deltas(tree("x"))
    with tally.Client(address(scoped, transport), token="ta-secret") as team_a:
        with team_a.writer(mine, writer_id="a1") as w:
            w.apply_deltas(tree("y"))
        # By name: every operation on team B's checkpoint is refused, naming team A's prefix.
        with pytest.raises(tally.PermissionDenied, match="starting with 'team-a/'"):
            team_a.writer(theirs, writer_id="a2").open()
        with pytest.raises(tally.PermissionDenied, match="starting with 'team-a/'"):
            team_a.are_completed(theirs, ["x"])
        for read in (team_a.checkpoint, team_a.events, team_a.progress, team_a.writers):
            with pytest.raises(tally.PermissionDenied):
                read(theirs)
        with pytest.raises(tally.PermissionDenied):
            list(team_a.completed(theirs))
        with pytest.raises(tally.PermissionDenied):
            next(iter(team_a.watch(theirs, interval_s=0.1)))
        # Listings show team A its own checkpoints only.
        names = {c.name for c in team_a.checkpoints()}
        assert mine in names and not any(n.startswith("team-b/") for n in names)
    # By handle: team B's open writer is out of reach (no completing, un-completing or closing it).
    for action in ("keepalive", "deltas", "columns", "flush", "close"):
        assert raw_writer_call(scoped, transport, "ta-secret", action, handle) == "PERMISSION_DENIED", action
    with tally.Client(address(scoped, transport), token="tb-reader") as b_reader:
        assert b_reader.are_completed(theirs, ["x"]) == [True]
        assert b_reader.checkpoint(theirs).anomalies == 0
        names = {c.name for c in b_reader.checkpoints()}
        assert theirs in names and all(n.startswith("team-b/") for n in names)
    # Team B's own token still drives its writer.
    assert raw_writer_call(scoped, transport, "tb-secret", "close", handle) == "OK"


def test_http_scopes_read_the_checkpoint_the_handler_reads(scoped: RunningServer) -> None:
    with tally.Client(scoped.http_url, token="tb-secret") as team_b:
        with team_b.writer("team-b/params", writer_id="b") as w:
            w.apply_deltas(tree("x"))
    headers = {"authorization": "Bearer ta-secret"}
    # A repeated query parameter: the handler gets the last one, so that is the one checked.
    smuggled = [("checkpoint", "team-a/x"), ("checkpoint", "team-b/params")]
    response = httpx.get(f"{scoped.http_url}/v1/events", params=smuggled, headers=headers)
    assert response.status_code == 403 and response.json()["error"]["details"] == {"prefixes": ["team-a/"]}
    # A name that climbs out of the prefix is no checkpoint name at all.
    response = httpx.get(f"{scoped.http_url}/v1/checkpoints/team-a/%2E%2E/team-b/params", headers=headers)
    assert response.status_code == 400, response.text
    # Names in the JSON body are checked by their handlers.
    for path, body in [
        ("/v1/are-completed", {"checkpoint": "team-b/params", "source_ids": ["x"]}),
        ("/v1/writers", {"checkpoint": "team-b/params"}),
    ]:
        response = httpx.post(f"{scoped.http_url}{path}", json=body, headers=headers)
        assert response.status_code == 403, (path, response.text)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_metrics_auth_needs_an_unscoped_reader_token(tmp_path: Path, how: str) -> None:
    env = {"TALLY_TOKENS": SCOPED_TOKENS, **({"TALLY_METRICS_AUTH": "true"} if how == "env" else {})}
    args = ["--metrics-auth"] if how == "flag" else []
    with running_server(tmp_path / "data", settle_ms=0, env=env, args=args) as server:
        with tally.Client(server.grpc_address, token="w-secret") as worker:
            worker.writer("secret-project/run", writer_id="w").open()
        url = f"{server.http_url}/metrics"
        anonymous = httpx.get(url)
        assert anonymous.status_code == 401 and "secret-project" not in anonymous.text
        assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
        scoped_reply = httpx.get(url, headers={"authorization": "Bearer tb-reader"})
        assert scoped_reply.status_code == 403 and "unscoped token" in scoped_reply.text
        for token in ("r-secret", "w-secret", "a-secret"):
            reply = httpx.get(url, headers={"authorization": f"Bearer {token}"})
            assert reply.status_code == 200 and "secret-project" in reply.text
        # Probes stay open.
        assert httpx.get(f"{server.http_url}/healthz").status_code == 200
        assert httpx.get(f"{server.http_url}/readyz").status_code == 200

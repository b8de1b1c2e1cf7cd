"""Tokens and roles over both transports against a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import tally
from tally_server.testing import running_server
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

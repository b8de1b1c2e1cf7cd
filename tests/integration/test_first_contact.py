"""No coordinator at all fails at once; a coordinator that answered once is waited for (issue 13).

A refused first connection means nothing runs there: the SDK says so, and how to start one,
instead of retrying for the whole timeout. A client that did reach its coordinator rides out a
restart as before, and says what it is waiting for meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tally
from tally_server.testing import running_server
from tests.conftest import free_ports
from tests.polling import wait_until

TIMEOUT = 30.0  # the SDK's default: a client that retried would take all of it
QUICK = TIMEOUT / 6  # "well under the timeout", with room for a loaded machine


def closed_address(wire: str) -> str:
    (port,) = free_ports(1)
    return f"127.0.0.1:{port}" if wire == "grpc" else f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_no_coordinator_fails_at_once_saying_what_to_start(wire: str) -> None:
    address = closed_address(wire)
    started = time.monotonic()
    with tally.Client(address, timeout=TIMEOUT) as client, pytest.raises(tally.Unavailable) as info:
        client.checkpoints()
    assert time.monotonic() - started < QUICK
    message = info.value.message
    assert f"no Tally coordinator is listening at {address} (connection refused)" in message
    assert "start one with `tally serve` (`./dev serve` in a checkout)" in message
    assert "TALLY_ADDRESS" in message
    # A writer's open and a watch fail the same way.
    started = time.monotonic()
    with tally.Client(address, timeout=TIMEOUT) as client:
        with pytest.raises(tally.Unavailable, match="no Tally coordinator is listening"):
            client.writer("first/contact").open()
        with pytest.raises(tally.Unavailable, match="no Tally coordinator is listening"):
            next(iter(client.watch("first/contact")))
    assert time.monotonic() - started < QUICK


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_the_async_client_fails_at_once_too(wire: str) -> None:
    address = closed_address(wire)

    async def main() -> tally.Unavailable:
        async with tally.AsyncClient(address, timeout=TIMEOUT) as client:
            with pytest.raises(tally.Unavailable) as info:
                await client.checkpoint("first/contact")
            return info.value

    started = time.monotonic()
    err = asyncio.run(main())
    assert time.monotonic() - started < QUICK
    assert f"no Tally coordinator is listening at {address}" in err.message


def test_the_cli_fails_at_once_in_one_line() -> None:
    address = closed_address("grpc")
    started = time.monotonic()
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "tally"),
            "status",
            "--address",
            address,
            "--timeout",
            str(TIMEOUT),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert time.monotonic() - started < QUICK
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: no Tally coordinator is listening at {address} (connection refused); start one with "
        "`tally serve` (`./dev serve` in a checkout), or point TALLY_ADDRESS (the CLI's --address) at a "
        "running one (TALLY_CONNECT_WAIT=SECONDS waits that long for one that is starting)"
    ]


def test_a_list_fails_at_once_only_when_no_replica_listens(tmp_path: Path) -> None:
    down = closed_address("grpc")
    with running_server(tmp_path / "data") as server:
        # One replica not listening is a move to the next, not an error.
        with tally.Client(f"{down},{server.grpc_address}", timeout=TIMEOUT) as client:
            for _ in range(4):  # whichever replica the client starts on
                assert client.checkpoints() == []
    other = closed_address("grpc")
    started = time.monotonic()
    with tally.Client(f"{down},{other}", timeout=TIMEOUT) as client, pytest.raises(tally.Unavailable) as info:
        client.checkpoints()
    assert time.monotonic() - started < QUICK
    assert f"no Tally coordinator is listening at grpc://{down}, grpc://{other}" in info.value.message


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_a_client_that_reached_its_coordinator_waits_through_a_restart_and_says_so(
    tmp_path: Path, wire: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    with running_server(data) as first:
        address = first.grpc_address if wire == "grpc" else first.http_url
        ports = {"grpc_listen": first.grpc_address, "http_listen": first.http_address}
        client = tally.Client(address, timeout=TIMEOUT)
        assert client.checkpoints() == []  # reached once
        first.kill()
    answers: list[object] = []
    call = threading.Thread(target=lambda: answers.append(client.checkpoints()))
    with caplog.at_level(logging.WARNING, "tally"):
        call.start()
        # Refused now, but this client knows a coordinator runs here: it waits, and says for what.
        wait_until(
            lambda: any("retrying for up to" in r.getMessage() for r in caplog.records),
            timeout=QUICK,
            what="the warning that the client is retrying",
        )
        assert call.is_alive()
        retrying = next(r.getMessage() for r in caplog.records if "retrying for up to" in r.getMessage())
        assert retrying.startswith("list checkpoints: Tally coordinator at ")
        assert address.removeprefix("http://") in retrying
        with running_server(data, **ports):
            call.join(TIMEOUT)
    client.close()
    assert answers == [[]]


def test_with_a_connect_wait_a_client_waits_for_a_coordinator_that_is_still_starting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TALLY_CONNECT_WAIT``: a worker started before its coordinator (or while it restarts) waits."""
    monkeypatch.setenv("TALLY_CONNECT_WAIT", "60")
    grpc_port, http_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    client = tally.Client(address, timeout=TIMEOUT)
    answers: list[object] = []
    call = threading.Thread(target=lambda: answers.append(client.checkpoints()))
    with caplog.at_level(logging.WARNING, "tally"):
        call.start()
        wait_until(
            lambda: any("retrying for up to" in r.getMessage() for r in caplog.records),
            timeout=QUICK,
            what="the warning that the client is retrying",
        )
        assert call.is_alive()  # refused, and not failed at once
        with running_server(tmp_path / "data", grpc_listen=address, http_listen=f"127.0.0.1:{http_port}"):
            call.join(TIMEOUT)
    client.close()
    assert answers == [[]]
    monkeypatch.setenv("TALLY_CONNECT_WAIT", "soon")
    with pytest.raises(ValueError, match="TALLY_CONNECT_WAIT must be a number of seconds"):
        tally.Client(address)

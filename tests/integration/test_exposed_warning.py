"""``tally serve`` warns once when anyone on the network may use it unauthenticated (issue #13, item 1).

Real processes: a coordinator without tokens listening on all addresses (gRPC or HTTP, IPv4 or
IPv6) logs one WARNING line naming the exposed addresses and what to do; on loopback addresses, or
with tokens, it does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tally_server.testing import RunningServer, running_server
from tests.polling import wait_until

WARNING = "WARNING tally_server.app [-]: authentication is off (no tokens configured)"


def started_log(server: RunningServer) -> str:
    """The log once startup is over (its last line says where data and completions are)."""
    wait_until(lambda: "tally serving" in server.log(), timeout=30, what="the 'tally serving' log line")
    return server.log()


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "authentication is off" in line]


@pytest.mark.parametrize(
    ("grpc_listen", "http_listen", "exposed"),
    [
        ("0.0.0.0:0", "0.0.0.0:0", "on 0.0.0.0:0 and 0.0.0.0:0:"),
        ("0.0.0.0:0", "127.0.0.1:0", "on 0.0.0.0:0:"),
        ("127.0.0.1:0", "[::]:0", "on [::]:0:"),
    ],
    ids=["both", "grpc-only", "http-ipv6-any"],
)
def test_no_tokens_on_a_non_loopback_address_is_one_warning_line(
    tmp_path: Path, grpc_listen: str, http_listen: str, exposed: str
) -> None:
    with running_server(
        tmp_path / "data", grpc_listen=grpc_listen, http_listen=http_listen, env={"TALLY_TOKENS": ""}
    ) as server:
        log = started_log(server)
    (line,) = warnings(log)
    assert WARNING in line, log
    assert exposed in line, line  # which addresses
    assert "set TALLY_TOKENS or TALLY_TOKENS_FILE" in line and "or listen on 127.0.0.1" in line  # what to do


@pytest.mark.parametrize(
    ("grpc_listen", "http_listen"),
    [("127.0.0.1:0", "127.0.0.1:0"), ("localhost:0", "[::1]:0")],
    ids=["ipv4-loopback", "localhost-ipv6-loopback"],
)
def test_no_tokens_on_loopback_only_is_no_warning(tmp_path: Path, grpc_listen: str, http_listen: str) -> None:
    with running_server(
        tmp_path / "data", grpc_listen=grpc_listen, http_listen=http_listen, env={"TALLY_TOKENS": ""}
    ) as server:
        log = started_log(server)
    assert warnings(log) == [], log
    assert " WARNING " not in log, log


def test_tokens_on_all_addresses_is_no_authentication_warning(tmp_path: Path) -> None:
    with running_server(
        tmp_path / "data",
        grpc_listen="0.0.0.0:0",
        http_listen="0.0.0.0:0",
        env={"TALLY_TOKENS": "t0ken:admin"},
    ) as server:
        log = started_log(server)
    assert warnings(log) == [], log
    assert "bearer tokens travel in plain text on 0.0.0.0:0" in log  # the other warning still holds

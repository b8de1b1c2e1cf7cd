"""A DNS name of several records as the coordinator's address: which records make replicas, how each
replica presents the name, and the failover transport following the name's records as they change.

The system resolver's side is tested against real ``tally serve`` processes in
``tests/integration/test_dns_replicas.py``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import tally
from tally import _calls as calls
from tally._transport import dns, failover
from tally._transport.base import Endpoint, parse_address
from tally._transport.failover import AsyncFailoverTransport, FailoverTransport
from tests.unit.client.tally_fakes import AsyncFakeTransport, FakeTransport, make_status

GET = calls.GetCheckpoint("cp")
V4, V6 = socket.AF_INET, socket.AF_INET6


def info(family: int, address: str) -> tuple[int, int, int, str, tuple[str, int]]:
    return (family, socket.SOCK_STREAM, 6, "", (address, 50051))


@pytest.mark.parametrize(
    ("found", "replicas"),
    [
        # Several A records: one replica each, in the resolver's order, each once.
        ([info(V4, "10.0.0.2"), info(V4, "10.0.0.1"), info(V4, "10.0.0.2")], ["10.0.0.2", "10.0.0.1"]),
        # localhost on many systems: one machine reached two ways, not two replicas.
        ([info(V6, "::1"), info(V4, "127.0.0.1")], ["127.0.0.1"]),
        # A dual-stack headless Service: each pod once, by the family with more records (IPv4 on a tie).
        ([info(V6, "fd00::1"), info(V6, "fd00::2"), info(V4, "10.0.0.1")], ["fd00::1", "fd00::2"]),
        (
            [info(V6, "fd00::1"), info(V6, "fd00::2"), info(V4, "10.0.0.1"), info(V4, "10.0.0.2")],
            ["10.0.0.1", "10.0.0.2"],
        ),
        ([], []),
    ],
)
def test_the_family_with_most_addresses_makes_the_replicas(found: list, replicas: list[str]) -> None:
    assert dns.one_family(found) == replicas


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("tally.example:50051", "tally.example", 50051),
        ("grpcs://tally.example:443", "tally.example", 443),
        ("[::1]:50051", "::1", 50051),
        ("tally.example", None, None),  # no port: the wire resolves the name itself, as before
        ("http://tally.example:8080/prefix", "tally.example", 8080),
        ("https://tally.example", "tally.example", 443),
        ("http://tally.example", "tally.example", 80),
    ],
)
def test_host_and_port(address: str, host: str | None, port: int | None) -> None:
    assert dns.host_and_port(parse_address(address)) == (host, port)


def test_each_replica_connects_to_an_address_and_presents_the_name() -> None:
    grpc = dns.at_address(parse_address("grpcs://tally.example:50051"), "tally.example", "10.0.0.7")
    assert grpc == Endpoint("grpc", "10.0.0.7:50051", True, "tally.example:50051", "tally.example")
    v6 = dns.at_address(parse_address("tally.example:50051"), "tally.example", "fd00::7")
    assert v6.target == "[fd00::7]:50051"
    http = dns.at_address(parse_address("https://tally.example/tally"), "tally.example", "10.0.0.7")
    assert http == Endpoint("http", "https://10.0.0.7/tally", True, "tally.example", "tally.example")
    ported = dns.at_address(parse_address("http://tally.example:8080"), "tally.example", "10.0.0.7")
    assert (ported.target, ported.authority) == ("http://10.0.0.7:8080", "tally.example:8080")


def test_addresses_that_are_not_names_are_never_looked_up() -> None:
    for address in ("127.0.0.1:50051", "[::1]:50051", "http://127.0.0.1:8080", "tally.example"):
        endpoint = parse_address(address)
        assert dns.replicas_of(endpoint) == [endpoint]


# ---------------------------------------------------------------- the name's records change


class Name:
    """A DNS name's records as the failover transport's lookup sees them: one fake per address."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] | None = list(addresses)
        self.fakes: dict[str, FakeTransport] = {}
        self.lookups = 0

    def fake(self, address: str) -> FakeTransport:
        if address not in self.fakes:
            self.fakes[address] = FakeTransport()
            self.fakes[address].checkpoint_names.append("cp")
        return self.fakes[address]

    def lookup(self) -> list[tuple[str, Callable[[], FakeTransport]]]:
        self.lookups += 1
        if self.addresses is None:
            return []  # could not be looked up now
        return [(address, lambda address=address: self.fake(address)) for address in self.addresses]

    def transport(self) -> FailoverTransport:
        found = self.lookup()
        return FailoverTransport([(name, make()) for name, make in found], start=0, lookup=self.lookup)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(failover, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_a_failing_replica_looks_the_name_up_again_at_most_every_30_s(
    clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    name = Name("a", "b")
    transport = name.transport()
    assert name.lookups == 1
    name.fakes["a"].fail("get_checkpoint", tally.Unavailable("refused"))
    name.addresses = ["b", "c"]  # a left the name, c joined
    with pytest.raises(tally.Unavailable):
        transport.send(GET, 1.0)
    assert name.lookups == 1  # looked up at start, not due yet: the rotation moves as for a list
    assert transport.replicas == ["a", "b"] and transport.current == "b"

    clock[0] += dns.LOOKUP_EVERY_S
    name.fakes["b"].fail("get_checkpoint", tally.Unavailable("refused"))
    with caplog.at_level(logging.INFO, "tally._transport.failover"), pytest.raises(tally.Unavailable):
        transport.send(GET, 1.0)
    assert name.lookups == 2
    assert transport.replicas == ["b", "c"]
    assert "tally coordinator replicas are now b, c (were a, b)" in caplog.text
    assert transport.send(GET, 1.0) == make_status("cp")  # on a live replica of the new records
    assert not name.fakes["a"].closed  # a call may still be on it: closed with the client
    transport.close()
    assert all(fake.closed for fake in name.fakes.values())


def test_a_replica_still_in_the_name_keeps_its_transport_and_the_rotation_its_place(
    clock: list[float],
) -> None:
    name = Name("a", "b", "c")
    transport = name.transport()
    name.fakes["a"].fail("get_checkpoint", tally.Unavailable("refused"))
    clock[0] += dns.LOOKUP_EVERY_S
    name.addresses = ["c", "b", "d"]
    with pytest.raises(tally.Unavailable):
        transport.send(GET, 1.0)
    assert transport.current == "b"  # moved off a to b; b is still there, so it stays current
    assert transport.send(GET, 1.0) == make_status("cp")
    assert name.fakes["b"].count("get_checkpoint") == 1 and "d" in name.fakes
    assert transport._view.transports[1] is name.fakes["b"]


def test_a_name_that_cannot_be_looked_up_keeps_the_replicas_known(clock: list[float]) -> None:
    name = Name("a", "b")
    transport = name.transport()
    name.fakes["a"].fail("get_checkpoint", tally.Unavailable("refused"))
    name.addresses = None
    clock[0] += dns.LOOKUP_EVERY_S
    with pytest.raises(tally.Unavailable):
        transport.send(GET, 1.0)
    assert name.lookups == 2 and transport.replicas == ["a", "b"]
    assert transport.send(GET, 1.0) == make_status("cp")


def test_the_asyncio_flavour_looks_the_name_up_off_the_event_loop(clock: list[float]) -> None:
    name = Name("a", "b")
    threads: list[str] = []

    def lookup() -> list[tuple[str, Callable[[], AsyncFakeTransport]]]:
        threads.append(threading.current_thread().name)
        return [(n, lambda make=make: AsyncFakeTransport(make())) for n, make in name.lookup()]

    transport = AsyncFailoverTransport([(n, make()) for n, make in lookup()], start=0, lookup=lookup)
    name.fakes["a"].fail("get_checkpoint", tally.Unavailable("refused"))
    name.addresses = ["b", "c"]
    clock[0] += dns.LOOKUP_EVERY_S

    async def run() -> None:
        with pytest.raises(tally.Unavailable):
            await transport.send(GET, 1.0)
        assert await transport.send(GET, 1.0) == make_status("cp")
        await transport.close()

    asyncio.run(run())
    assert transport.replicas == ["b", "c"] and name.fakes["b"].count("get_checkpoint") == 1
    assert threads[0] == threading.current_thread().name and threads[1] != threads[0]
    assert all(fake.closed for fake in name.fakes.values())

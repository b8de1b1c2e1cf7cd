"""Address lists and the failover transport over several replicas' fake transports."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace

import pytest

import tally
from tally import _calls as calls
from tally import _retry
from tally._client import AsyncClient, Client
from tally._config import ClientConfig, is_tls_address
from tally._transport import failover
from tally._transport.base import Endpoint, make_async_transport, make_transport, parse_addresses
from tally._transport.failover import AsyncFailoverTransport, FailoverTransport
from tally._transport.grpc import AsyncGrpcTransport, GrpcTransport
from tally._transport.http import AsyncHttpTransport, HttpTransport
from tests.unit.client.tally_fakes import (
    TEST_CONFIG,
    WAIT_S,
    AsyncFakeTransport,
    FakeTransport,
    deltas,
    make_status,
    no_tally_threads,
)

NAMES = ["grpc://r0:1", "grpc://r1:1", "grpc://r2:1"]
LOGGER = "tally._transport.failover"


def replicas(n: int = 3) -> list[FakeTransport]:
    fakes = [FakeTransport() for _ in range(n)]
    for fake in fakes:
        fake.checkpoint_names.append("cp")
    return fakes


def over(fakes: Sequence[FakeTransport], start: int = 0) -> FailoverTransport:
    return FailoverTransport(list(zip(NAMES, fakes, strict=False)), start=start)


def async_over(fakes: Sequence[FakeTransport], start: int = 0) -> AsyncFailoverTransport:
    wrapped = [AsyncFakeTransport(f) for f in fakes]
    return AsyncFailoverTransport(list(zip(NAMES, wrapped, strict=False)), start=start)


def client_over(transport: FailoverTransport, **overrides: object) -> Client:
    client = Client.__new__(Client)
    client._init(replace(TEST_CONFIG, **overrides), transport)
    return client


def async_client_over(transport: AsyncFailoverTransport, **overrides: object) -> AsyncClient:
    client = AsyncClient.__new__(AsyncClient)
    client._init(replace(TEST_CONFIG, **overrides), transport)
    return client


GET = calls.GetCheckpoint("cp")

# ---------------------------------------------------------------- address lists


@pytest.mark.parametrize(
    ("address", "endpoints"),
    [
        ("h1:1,h2:2", [Endpoint("grpc", "h1:1", False), Endpoint("grpc", "h2:2", False)]),
        (" h1:1 ,  grpc://h2:2 ", [Endpoint("grpc", "h1:1", False), Endpoint("grpc", "h2:2", False)]),
        ("grpcs://h1:1,GRPCS://h2:2", [Endpoint("grpc", "h1:1", True), Endpoint("grpc", "h2:2", True)]),
        (
            "http://h1:8080/t/, http://h2:8080,http://h3:8080",
            [
                Endpoint("http", "http://h1:8080/t", False),
                Endpoint("http", "http://h2:8080", False),
                Endpoint("http", "http://h3:8080", False),
            ],
        ),
        (
            "https://h1:1,https://h2:1",
            [Endpoint("http", "https://h1:1", True), Endpoint("http", "https://h2:1", True)],
        ),
        ("  h1:1  ", [Endpoint("grpc", "h1:1", False)]),
    ],
)
def test_address_lists_parse(address: str, endpoints: list[Endpoint]) -> None:
    assert parse_addresses(address) == endpoints


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("h1:1,", r"address list 'h1:1,' has an empty element \(number 2\).*e\.g\. h1:50051,h2:50051"),
        (",h1:1", r"empty element \(number 1\)"),
        ("h1:1,,h2:1", r"empty element \(number 2\); separate replicas with single commas"),
        ("h1:1, ,h2:1", r"empty element \(number 2\)"),
        (
            "h1:1,http://h2:8080",
            r"mixes gRPC and HTTP: 'h1:1' is gRPC but 'http://h2:8080' is HTTP; list every replica on one "
            r"wire, e\.g\. h1:50051,h2:50051 or http://h1:8080,http://h2:8080",
        ),
        (
            "https://h1:1, grpcs://h2:1",
            r"mixes gRPC and HTTP: 'https://h1:1' is HTTP but 'grpcs://h2:1' is gRPC",
        ),
        (
            "grpcs://h1:1,h2:1",
            r"mixes TLS and plain text: 'grpcs://h1:1' and 'h2:1'; use grpcs:// \(or https://\) for every "
            r"replica, or for none",
        ),
        ("http://h1:1,https://h2:1", "mixes TLS and plain text"),
        ("h1:1,ftp://h2:1", r"unsupported address scheme 'ftp' in 'ftp://h2:1'"),
        ("h1:1,grpc://", "has no host"),
    ],
)
def test_address_lists_refuse_with_what_to_write(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_addresses(address)
    with pytest.raises(ValueError, match=message):
        tally.Client(address)
    with pytest.raises(ValueError, match=message):
        tally.AsyncClient(address)


def test_one_address_gets_its_transport_alone() -> None:
    for address, kind, async_kind in [
        ("h1:1", GrpcTransport, AsyncGrpcTransport),
        ("http://h1:1", HttpTransport, AsyncHttpTransport),
    ]:
        config = ClientConfig(address=address)
        transport = make_transport(config)
        assert type(transport) is kind
        transport.close()
        assert type(make_async_transport(config)) is async_kind


def test_a_list_gets_one_transport_per_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "first_replica", lambda count: count - 1)
    transport = make_transport(ClientConfig(address="h1:1, grpc://h2:2"))
    assert isinstance(transport, FailoverTransport)
    assert [type(t) for t in transport._view.transports] == [GrpcTransport, GrpcTransport]
    assert transport.replicas == ["grpc://h1:1", "grpc://h2:2"] and transport.current == "grpc://h2:2"
    transport.close()
    aio = make_async_transport(ClientConfig(address="https://h1:1,https://h2:2/x"))
    assert isinstance(aio, AsyncFailoverTransport)
    assert [type(t) for t in aio._view.transports] == [AsyncHttpTransport, AsyncHttpTransport]
    assert aio.replicas == ["https://h1:1", "https://h2:2/x"]


def test_clients_and_the_environment_take_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_ADDRESS", "http://e1:8080,http://e2:8080")
    with tally.Client() as client:
        assert client.address == "http://e1:8080,http://e2:8080"
        assert isinstance(client._transport, FailoverTransport)
    config = ClientConfig.from_env()
    assert config.address == "http://e1:8080,http://e2:8080"
    with tally.Client.from_config(config) as client:
        assert isinstance(client._transport, FailoverTransport)
    aclient = tally.AsyncClient.from_config(config)
    assert isinstance(aclient._transport, AsyncFailoverTransport)
    asyncio.run(aclient.close())
    with tally.Client("h1:1,h2:1") as client:
        assert isinstance(client._transport, FailoverTransport)


def test_tls_settings_apply_to_lists() -> None:
    assert is_tls_address("grpcs://h1:1,grpcs://h2:1") and is_tls_address("h1:1, https://h2:1")
    assert not is_tls_address("h1:1,grpc://h2:1")
    ClientConfig(address="grpcs://h1:1,grpcs://h2:1", ca_cert="ca.pem")  # accepted
    with pytest.raises(ValueError, match="is not TLS"):
        ClientConfig(address="h1:1,h2:1", ca_cert="ca.pem")


def test_clients_start_on_a_random_replica() -> None:
    address = ",".join(f"http://r{i}:8080" for i in range(3))
    starts = set()
    for _ in range(60):  # all three are seen unless the random choice is broken (chance 3 * (2/3)**60)
        client = tally.Client(address)
        assert isinstance(client._transport, FailoverTransport)
        starts.add(client._transport.current)
        client.close()
    assert starts == {f"http://r{i}:8080" for i in range(3)}


# ---------------------------------------------------------------- moving between replicas


def test_unavailable_moves_to_the_next_replica_and_is_raised(caplog: pytest.LogCaptureFixture) -> None:
    fakes = replicas()
    transport = over(fakes, start=2)
    fakes[2].fail("get_checkpoint", tally.Unavailable("connection refused"))
    with caplog.at_level(logging.INFO, LOGGER), pytest.raises(tally.Unavailable, match="refused"):
        transport.send(GET, 1.0)
    assert transport.current == NAMES[0]  # round robin wraps around
    assert transport.send(GET, 1.0) == make_status("cp")
    assert [f.count("get_checkpoint") for f in fakes] == [1, 0, 1]
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "tally coordinator grpc://r2:1 is unavailable, moving to grpc://r0:1: connection refused"
    )


@pytest.mark.parametrize(
    "error",
    [
        tally.NotFound("no such checkpoint"),
        tally.InvalidArgument("bad name"),
        tally.PermissionDenied("reader"),
        tally.FailedPrecondition("fingerprint"),
        tally.Internal("bug"),
    ],
)
def test_other_errors_never_move(error: tally.TallyError, caplog: pytest.LogCaptureFixture) -> None:
    fakes = replicas()
    transport = over(fakes, start=1)
    fakes[1].fail("get_checkpoint", error)
    with caplog.at_level(logging.INFO, LOGGER), pytest.raises(type(error)):
        transport.send(GET, 1.0)
    assert transport.current == NAMES[1]
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_the_client_retries_on_the_next_replica_within_its_deadline() -> None:
    fakes = replicas()
    client = client_over(over(fakes, start=0))
    fakes[0].fail("get_checkpoint", tally.Unavailable("down"))
    fakes[1].fail("get_checkpoint", tally.Unavailable("shutting down"))
    assert client.checkpoint("cp") == make_status("cp")
    assert [f.count("get_checkpoint") for f in fakes] == [1, 1, 1]
    for fake in fakes:  # one store behind every replica
        fake.completed.add("a")
    assert client.are_completed("cp", ["a", "b"]) == [True, False]
    with pytest.raises(tally.NotFound):
        client.checkpoint("missing")  # refused by the replica in use: asked once, nowhere else
    assert [f.count("get_checkpoint") for f in fakes] == [1, 1, 2]
    client.close()
    assert all(f.closed for f in fakes)


def test_one_replica_down_costs_the_first_call_one_short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default policy's first delay is what a move costs; a long one would stall every client
    # that starts on a dead replica.
    slept: list[float] = []
    monkeypatch.setattr(_retry, "time", SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    fakes = replicas(2)
    client = client_over(over(fakes, start=0), retry_initial_s=ClientConfig.retry_initial_s, retry_max_s=5.0)
    fakes[0].fail("are_completed", tally.Unavailable("connection refused"))
    assert client.are_completed("cp", ["a"]) == [False]
    assert len(slept) == 1 and 0 < slept[0] <= ClientConfig.retry_initial_s <= 0.05
    client.close()


def test_reads_go_round_the_replicas_and_everything_else_to_the_current_one() -> None:
    fakes = replicas()
    for fake in fakes:
        fake.completed.add("a")
    client = client_over(over(fakes, start=1))
    for _ in range(6):
        assert client.are_completed("cp", ["a", "b"]) == [True, False]
        assert client.checkpoint("cp") == make_status("cp")
    assert [f.count("are_completed") for f in fakes] == [2, 2, 2]
    assert [f.count("get_checkpoint") for f in fakes] == [0, 6, 0]
    client.close()


def test_reads_pass_by_a_replica_that_did_not_answer_for_a_while(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(failover, "time", SimpleNamespace(monotonic=lambda: now[0]))
    fakes = replicas()
    transport = over(fakes, start=0)
    fakes[1].fail("are_completed", tally.Unavailable("connection refused"))
    read = calls.AreCompleted("cp", ["a"])
    assert transport.send(read, 1.0) == [False]  # r0
    with caplog.at_level(logging.INFO, LOGGER), pytest.raises(tally.Unavailable):
        transport.send(read, 1.0)  # r1: no answer
    assert "grpc://r1:1 did not answer a read, reads pass it by for 5 s" in caplog.text
    assert transport.current == NAMES[0]  # a read failing moves no writer
    for _ in range(4):
        transport.send(read, 1.0)
    assert [f.count("are_completed") for f in fakes] == [3, 1, 2]  # r2 r0 r2 r0
    now[0] += failover.READ_PAUSE_S
    for _ in range(3):
        transport.send(read, 1.0)
    assert [f.count("are_completed") for f in fakes] == [4, 2, 3]  # r1 again, r2, r0


def test_concurrent_failures_of_one_replica_move_once(caplog: pytest.LogCaptureFixture) -> None:
    fakes = replicas()
    transport = over(fakes, start=0)
    gate = fakes[0].hold("get_checkpoint")
    fakes[0].fail("get_checkpoint", *[tally.Unavailable("reset by peer")] * 3)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            transport.send(GET, 1.0)
        except tally.Unavailable as err:
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    with caplog.at_level(logging.INFO, LOGGER):
        for t in threads:
            t.start()
        fakes[0].wait_calls("get_checkpoint", 3)  # all three are out on replica 0
        gate.set()
        for t in threads:
            t.join(WAIT_S)
    assert len(errors) == 3
    assert transport.current == NAMES[1]  # not r2, nor back round to r0
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1


def test_a_late_failure_does_not_move_a_client_that_came_back_round() -> None:
    # r0 fails, r1 fails: the client is on r0 again. A call sent to r0 before all that fails only
    # now; it says nothing about the r0 the client just came back to.
    fakes = replicas(2)
    transport = over(fakes, start=0)
    gate = fakes[0].hold("are_completed")
    fakes[0].fail("are_completed", tally.Unavailable("old connection broke"))
    errors: list[BaseException] = []

    def late_call() -> None:
        try:
            transport.send(calls.AreCompleted("cp", ["a"]), 1.0)
        except tally.Unavailable as err:
            errors.append(err)

    late = threading.Thread(target=late_call)
    late.start()
    fakes[0].wait_calls("are_completed", 1)
    fakes[0].fail("get_checkpoint", tally.Unavailable("down"))
    fakes[1].fail("get_checkpoint", tally.Unavailable("down"))
    for _ in range(2):
        with pytest.raises(tally.Unavailable):
            transport.send(GET, 1.0)
    assert transport.current == NAMES[0]
    gate.set()
    late.join(WAIT_S)
    assert not late.is_alive() and len(errors) == 1
    assert transport.current == NAMES[0]


def test_async_concurrent_failures_move_once_and_retry_on_the_next() -> None:
    fakes = replicas()
    transport = async_over(fakes, start=0)
    gate = fakes[0].hold("get_checkpoint")
    fakes[0].fail("get_checkpoint", *[tally.Unavailable("reset")] * 3)

    async def main() -> None:
        tasks = [asyncio.create_task(transport.send(GET, 1.0)) for _ in range(3)]
        await asyncio.to_thread(fakes[0].wait_calls, "get_checkpoint", 3)
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, tally.Unavailable) for r in results)
        assert transport.current == NAMES[1]
        client = async_client_over(transport)
        fakes[1].fail("get_checkpoint", tally.Unavailable("down"))
        assert await client.checkpoint("cp") == make_status("cp")
        assert [f.count("get_checkpoint") for f in fakes] == [3, 1, 1]
        fakes[2].fail("get_checkpoint", tally.InvalidArgument("no"))
        with pytest.raises(tally.InvalidArgument):
            await client.checkpoint("cp")
        assert transport.current == NAMES[2]
        await client.close()

    asyncio.run(main())
    assert all(f.closed for f in fakes)


class _BrokenClose(FakeTransport):
    def close(self) -> None:
        super().close()
        raise RuntimeError("close failed")


def test_close_closes_every_replica_even_when_one_fails() -> None:
    fakes = [FakeTransport(), _BrokenClose(), FakeTransport()]
    with pytest.raises(RuntimeError, match="close failed"):
        over(fakes).close()
    assert all(f.closed for f in fakes)
    fakes = replicas()
    asyncio.run(async_over(fakes).close())
    assert all(f.closed for f in fakes)


# ---------------------------------------------------------------- watch


WATCH = calls.WatchCheckpoint("cp", 1000)


def test_watch_uses_the_current_replica_and_moves_when_it_fails() -> None:
    fakes = replicas()
    transport = over(fakes, start=1)
    fakes[1].watch_script.append([tally.Unavailable("connection refused")])
    fakes[2].watch_script.append([make_status("cp", 3)])
    stream = transport.watch(WATCH, 1.0)
    with pytest.raises(tally.Unavailable):
        next(stream)
    assert transport.current == NAMES[2] and fakes[1].watch_closed == 1
    assert list(transport.watch(WATCH, 1.0)) == [make_status("cp", 3)]
    assert fakes[2].watch_closed == 1
    fakes[2].watch_script.append([make_status("cp", 4), tally.NotFound("gone")])
    stream = transport.watch(WATCH, 1.0)
    assert next(stream) == make_status("cp", 4)
    with pytest.raises(tally.NotFound):
        next(stream)
    assert transport.current == NAMES[2]  # a refusal moves nothing
    fakes[2].watch_script.append([make_status("cp", 5), make_status("cp", 6)])
    stream = transport.watch(WATCH, 1.0)
    assert next(stream) == make_status("cp", 5)
    stream.close()  # closing the wrapper ends the replica's stream
    assert fakes[2].watch_closed == 3


def test_client_watch_reconnects_to_the_next_replica() -> None:
    fakes = replicas(2)
    client = client_over(over(fakes, start=0))
    fakes[0].watch_script.append([tally.Unavailable("down")])
    fakes[1].watch_script.append([make_status("cp", 7)])
    stream = client.watch("cp")
    assert next(stream) == make_status("cp", 7)
    stream.close()
    assert fakes[0].count("watch") == 1 and fakes[1].count("watch") == 1
    client.close()


def test_async_watch_moves_when_it_fails() -> None:
    fakes = replicas(2)
    transport = async_over(fakes, start=0)
    fakes[0].watch_script.append([tally.Unavailable("down")])
    fakes[1].watch_script.append([make_status("cp", 2)])

    async def main() -> None:
        client = async_client_over(transport)
        stream = client.watch("cp")
        assert await anext(stream) == make_status("cp", 2)
        await stream.aclose()  # type: ignore[attr-defined]
        assert transport.current == NAMES[1]
        await client.close()

    asyncio.run(main())
    assert [f.watch_closed for f in fakes] == [1, 1]


# ---------------------------------------------------------------- writers need nothing special


def test_writer_opens_resends_and_closes_across_replicas() -> None:
    fakes = replicas(2)
    client = client_over(over(fakes, start=0))
    fakes[0].fail("open_writer", tally.Unavailable("down"))
    fakes[1].fail("apply_deltas", tally.Unavailable("shutting down"))
    sent = deltas(5)
    with client.writer("cp") as w:
        assert fakes[1].count("open_writer") == 1  # opened on the replica that answered
        w.apply_deltas(sent)
        w.flush()
    # The batch that r1 dropped went again, same sequence number, to r0 (where the client moved).
    assert [seq for seq, _ in fakes[1].attempts] == [1] and fakes[1].applied == []
    assert [seq for seq, _ in fakes[0].attempts] == [1] and fakes[0].applied == sent
    assert fakes[0].calls[-2:] == ["flush", "close_writer"]
    client.close()
    assert no_tally_threads()


def test_async_writer_opens_resends_and_closes_across_replicas() -> None:
    fakes = replicas(2)
    transport = async_over(fakes, start=1)
    fakes[1].fail("open_writer", tally.Unavailable("down"))
    fakes[0].fail("apply_deltas", tally.Unavailable("shutting down"))
    sent = deltas(4)

    async def main() -> None:
        client = async_client_over(transport)
        async with client.writer("cp") as w:
            w.apply_deltas(sent)
            await w.flush()
        await client.close()

    asyncio.run(main())
    assert fakes[0].count("open_writer") == 1
    assert [seq for seq, _ in fakes[0].attempts] == [1] and fakes[0].applied == []
    assert [seq for seq, _ in fakes[1].attempts] == [1] and fakes[1].applied == sent
    assert fakes[1].calls[-2:] == ["flush", "close_writer"]


def test_a_failed_heartbeat_moves_the_writer_too() -> None:
    fakes = [FakeTransport(lease_ttl_s=0.05), FakeTransport(lease_ttl_s=0.05)]
    client = client_over(over(fakes, start=0))
    fakes[0].fail("keep_alive", tally.Unavailable("down"))
    with client.writer("cp"):
        fakes[1].wait_calls("keep_alive", 1)  # the heartbeat after the failed one went to r1
    assert fakes[0].count("keep_alive") == 1
    client.close()

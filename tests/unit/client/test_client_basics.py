"""Errors, configuration, address parsing, retry policy and the Client's own calls."""

from __future__ import annotations

import asyncio
import pickle

import pytest

import tally
from tally._calls import ARE_COMPLETED_CHUNK
from tally._config import ClientConfig
from tally._retry import Deadline, RetryPolicy, async_call_with_retry
from tally._transport.base import Endpoint, parse_address
from tally.errors import StatusCode, error_for_code
from tests.unit.client.tally_fakes import FakeTransport, make_client, make_status

# ---------------------------------------------------------------- errors


def test_every_status_code_maps_to_a_tally_error_class() -> None:
    for code in StatusCode:
        err = error_for_code(code, "msg", {"k": "v"})
        assert isinstance(err, tally.TallyError) and err.code is code and err.details == {"k": "v"}
    assert type(error_for_code(StatusCode.DEADLINE_EXCEEDED, "m")) is tally.Unavailable
    assert type(error_for_code(StatusCode.NOT_FOUND, "m")) is tally.NotFound


def test_errors_keep_code_and_details_through_pickling() -> None:
    err = tally.LeaseLost("gone", details={"writer": "w1"})
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is tally.LeaseLost and copy.code is StatusCode.NOT_FOUND
    assert copy.message == "gone" and copy.details == {"writer": "w1"} and str(copy) == "gone"
    assert "NOT_FOUND" in repr(copy)


# ---------------------------------------------------------------- config and addresses


def test_config_from_env() -> None:
    env = {"TALLY_ADDRESS": "http://coord:8080", "TALLY_TOKEN": "tok", "TALLY_TIMEOUT": "2.5"}
    assert ClientConfig.from_env(env) == ClientConfig(address="http://coord:8080", token="tok", timeout=2.5)
    assert ClientConfig.from_env({}) == ClientConfig()
    assert ClientConfig().address == "127.0.0.1:50051"
    with pytest.raises(ValueError, match="TALLY_TIMEOUT"):
        ClientConfig.from_env({"TALLY_TIMEOUT": "soon"})


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout": 0}, {"max_batch": 0}, {"max_buffered": 0}, {"flush_interval_s": 0}, {"address": ""}],
)
def test_config_rejects_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ClientConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("127.0.0.1:50051", Endpoint("grpc", "127.0.0.1:50051", False)),
        ("grpc://coord:1", Endpoint("grpc", "coord:1", False)),
        ("grpcs://coord:1", Endpoint("grpc", "coord:1", True)),
        ("[::1]:50051", Endpoint("grpc", "[::1]:50051", False)),
        ("http://coord:8080", Endpoint("http", "http://coord:8080", False)),
        ("HTTPS://coord:8443/tally/", Endpoint("http", "https://coord:8443/tally", True)),
    ],
)
def test_parse_address(address: str, endpoint: Endpoint) -> None:
    assert parse_address(address) == endpoint


@pytest.mark.parametrize("address", ["ftp://x:1", "grpc://", "grpc://h:1/path"])
def test_parse_address_refuses(address: str) -> None:
    with pytest.raises(ValueError):
        parse_address(address)


def test_client_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_ADDRESS", "http://from-env:8080")
    monkeypatch.setenv("TALLY_TOKEN", "env-token")
    monkeypatch.setenv("TALLY_TIMEOUT", "7")
    with tally.Client() as client:
        assert client.config == ClientConfig(address="http://from-env:8080", token="env-token", timeout=7.0)
    with tally.Client("127.0.0.1:1", token="", timeout=1.0) as client:
        assert (client.address, client.config.token, client.config.timeout) == ("127.0.0.1:1", None, 1.0)
    client = tally.Client.from_config(ClientConfig(address="grpc://h:1"))
    assert repr(client) == "Client(address='grpc://h:1')"
    client.close()


def test_unknown_scheme_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="unsupported address scheme"):
        tally.Client("ftp://coord:21")


# ---------------------------------------------------------------- retry policy


def test_backoff_grows_to_the_cap_with_bounded_jitter() -> None:
    policy = RetryPolicy(initial_s=0.1, max_s=1.0, jitter=0.2)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.0), (10_000, 1.0)]:
        assert base * 0.8 <= policy.delay(attempt) <= base


# ---------------------------------------------------------------- Client calls


def test_are_completed_is_chunked_and_keeps_order(fake: FakeTransport) -> None:
    client = make_client(fake)
    ids = [f"s{i}" for i in range(2 * ARE_COMPLETED_CHUNK + 5)]
    fake.completed.update(ids[::3])
    assert client.are_completed("cp", iter(ids)) == [i % 3 == 0 for i in range(len(ids))]
    assert fake.count("are_completed") == 3
    assert client.are_completed("cp", []) == []
    client.close()


def test_are_completed_validates_ids_locally(fake: FakeTransport) -> None:
    client = make_client(fake)
    with pytest.raises(tally.InvalidArgument, match="single str"):
        client.are_completed("cp", "abc")
    with pytest.raises(tally.InvalidArgument, match=r"source_ids\[1\]"):
        client.are_completed("cp", ["a", 2])  # type: ignore[list-item]
    client.close()


def test_are_completed_retries_then_raises_unavailable_after_the_timeout(fake: FakeTransport) -> None:
    fake.fail("are_completed", tally.Unavailable("blip"))
    client = make_client(fake)
    assert client.are_completed("cp", ["a"]) == [False]
    fake.fail("are_completed", *[tally.Unavailable("connection refused")] * 100_000)
    client = make_client(fake, timeout=0.1, retry_initial_s=0.01, retry_max_s=0.02)
    with pytest.raises(tally.Unavailable, match=r"no answer within 0\.1s; last error: connection refused"):
        client.are_completed("cp", ["a"])
    client.close()


def test_out_of_time_names_the_first_error_when_the_last_differs(fake: FakeTransport) -> None:
    # The last attempt fails only because the time ran out; the first said what is wrong.
    cause = tally.Unavailable("handshake refused (if the coordinator requires client certificates, ...)")
    fake.fail("are_completed", cause, *[tally.Unavailable("timed out")] * 100_000)
    client = make_client(fake, timeout=0.1, retry_initial_s=0.01, retry_max_s=0.02)
    with pytest.raises(tally.Unavailable) as info:
        client.are_completed("cp", ["a"])
    assert info.value.message.endswith(f"last error: timed out; first error: {cause.message}")
    client.close()


def test_non_retryable_errors_are_raised_at_once(fake: FakeTransport) -> None:
    client = make_client(fake)
    with pytest.raises(tally.NotFound, match="does not exist"):
        client.checkpoint("nope")
    assert fake.count("get_checkpoint") == 1
    fake.checkpoint_names.extend(["a", "b/c"])
    assert client.checkpoint("b/c") == make_status("b/c")
    assert [c.name for c in client.checkpoints()] == ["a", "b/c"]
    client.close()


def test_closed_client_refuses_calls(fake: FakeTransport) -> None:
    client = make_client(fake)
    client.close()
    assert fake.closed
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        client.checkpoints()
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        client.writer("cp")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"checkpoint": ""},
        {"checkpoint": "cp", "writer_id": ""},
        {"checkpoint": "cp", "labels": {"a": 1}},
        {"checkpoint": "cp", "fingerprint": ["x"]},
    ],
)
def test_writer_arguments_are_checked_locally(fake: FakeTransport, kwargs: dict[str, object]) -> None:
    client = make_client(fake)
    with pytest.raises(tally.InvalidArgument):
        client.writer(**kwargs)  # type: ignore[arg-type]
    client.close()


def test_the_async_retry_loop_names_the_first_error_too() -> None:
    errors = iter([tally.Unavailable("certificate refused"), *[tally.Unavailable("timed out")] * 100_000])

    async def attempt(_timeout: float) -> None:
        raise next(errors)

    policy = RetryPolicy(initial_s=0.01, max_s=0.02)
    with pytest.raises(tally.Unavailable) as info:
        asyncio.run(async_call_with_retry(attempt, policy, Deadline(0.1), "a call"))
    assert info.value.message.endswith("last error: timed out; first error: certificate refused")

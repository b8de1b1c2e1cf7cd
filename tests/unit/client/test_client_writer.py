"""The blocking Writer against a fake Transport: ordering, batching, retry, barrier, lease loss."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

import pytest

import tally
from tally import Client
from tally.errors import StatusCode
from tests.polling import wait_until
from tests.unit.client.tally_fakes import (
    WAIT_S,
    FakeTransport,
    deltas,
    make_client,
    no_tally_threads,
    wait_state,
)


def test_deltas_arrive_in_order_in_batches_of_at_most_max_batch(client: Client, fake: FakeTransport) -> None:
    sent = deltas(2500)
    with client.writer("cp") as w:
        for i in range(0, len(sent), 37):
            w.apply_deltas(sent[i : i + 37])
        w.flush()
        assert fake.applied == sent
        assert all(len(batch) <= 100 for _, batch in fake.attempts)
        seqs = [seq for seq, _ in fake.attempts]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # The Flush RPC is the barrier's second half: it follows the last batch.
        assert fake.calls[-1] == "flush"
        health = w.health()
        assert health.buffered == 0 and health.batches_sent == len(fake.attempts) and health.retries == 0


def test_small_calls_coalesce_while_a_batch_is_in_flight(client: Client, fake: FakeTransport) -> None:
    gate = fake.hold("apply_deltas")
    with client.writer("cp") as w:
        w.apply_deltas([("first", "s", 1)])
        fake.wait_calls("apply_deltas", 1)
        rest = deltas(250)
        for d in rest:
            w.apply_deltas([d])
        gate.set()
        w.flush()
    assert [len(b) for _, b in fake.attempts] == [1, 100, 100, 50]
    assert fake.applied == [("first", "s", 1), *rest]


def test_a_lone_delta_goes_out_within_the_flush_interval_without_flush(
    client: Client, fake: FakeTransport
) -> None:
    with client.writer("cp") as w:
        w.apply_deltas([("t", "s", 1)])
        fake.wait_calls("apply_deltas", 1)
    assert fake.applied == [("t", "s", 1)]


def test_unavailable_batch_is_resent_unchanged_before_later_deltas(
    client: Client, fake: FakeTransport
) -> None:
    fake.fail(
        "apply_deltas",
        tally.Unavailable("connection reset"),
        tally.Unavailable("deadline", tally.StatusCode.DEADLINE_EXCEEDED),
    )
    gate = fake.hold("apply_deltas")
    first, later = deltas(5, "a"), deltas(5, "b")
    with client.writer("cp") as w:
        w.apply_deltas(first)
        fake.wait_calls("apply_deltas", 1)
        w.apply_deltas(later)
        gate.set()
        w.flush()
        health = w.health()
    assert fake.attempts[0] == fake.attempts[1] == fake.attempts[2] == (1, first)
    assert fake.applied == first + later
    assert health.retries == 2
    assert health.last_error is not None and "DEADLINE_EXCEEDED" in health.last_error


def test_flush_waits_for_acknowledgement_and_times_out_as_unavailable(
    client: Client, fake: FakeTransport
) -> None:
    gate = fake.hold("apply_deltas")
    with client.writer("cp") as w:
        w.apply_deltas([("t", "s", 1)])
        fake.wait_calls("apply_deltas", 1)
        with pytest.raises(tally.Unavailable, match="1 delta not yet acknowledged"):
            w.flush(timeout=0.05)
        assert "flush" not in fake.calls
        assert w.health().buffered == 1
        gate.set()
        w.flush()  # the sender kept going; a later flush succeeds
    assert fake.applied == [("t", "s", 1)]


def test_flush_sends_no_call_when_the_last_answer_said_settled(client: Client, fake: FakeTransport) -> None:
    fake.settled = True
    with client.writer("cp") as w:
        w.apply_deltas(deltas(3))
        w.flush()
        assert fake.count("apply_deltas") == 1 and fake.count("flush") == 0
        fake.settled = False  # e.g. a source settling: the coordinator must be asked
        w.apply_deltas(deltas(2))
        w.flush()
        assert fake.count("flush") == 1


def test_small_apply_and_flush_wake_no_background_thread_needlessly(
    fake: FakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each wake-up of a background thread is a thread switch, as long as the small call itself.
    fake.settled = True
    client = make_client(fake, flush_interval_s=30.0)
    woken = {"sender": 0, "heartbeat": 0}
    with client.writer("cp") as w:
        for name, condition in (("sender", w._sending), ("heartbeat", w._beating)):
            notify_all = condition.notify_all

            def counted(name: str = name, notify_all: Callable[[], None] = notify_all) -> None:
                woken[name] += 1
                notify_all()

            monkeypatch.setattr(condition, "notify_all", counted)
        # The sender lingers (up to the flush interval) before it sends a delta, and after
        # deltas came it looks again within a flush interval before it waits to be woken: all
        # that time it looks at the buffer in time on its own.
        w.apply_deltas([("first", "s", 1)])
        wait_until(lambda: w._core.sender_looks_soon, timeout=WAIT_S, what="the sender lingers")
        assert woken["sender"] <= 1 and woken["heartbeat"] == 0
        before = dict(woken)
        w.flush()
        rounds = 50
        for i in range(rounds):
            w.apply_deltas([(f"t{i}", f"s{i}", 1)])
            w.flush()
        assert fake.count("apply_deltas") == rounds + 1 and fake.count("flush") == 0
        # Each flush sent its batch itself, and its answer concerns no background thread: the
        # sender is not woken while it lingers, nor by an answer that leaves it nothing to send;
        # the heartbeat only to stop.
        assert woken == before
    client.close()
    assert woken["heartbeat"] == 1  # close stopped it
    assert fake.applied == [("first", "s", 1), *((f"t{i}", f"s{i}", 1) for i in range(rounds))]
    assert no_tally_threads()


def test_flush_barrier_covers_only_deltas_given_before_it(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp") as w:
        w.apply_deltas(deltas(3))
        w.flush()
        assert len(fake.applied) == 3
        assert fake.count("flush") == 1


def test_full_buffer_blocks_the_producer_until_there_is_room(fake: FakeTransport) -> None:
    client = make_client(fake, max_buffered=10, max_batch=5)
    gate = fake.hold("apply_deltas")
    with client.writer("cp") as w:
        w.apply_deltas([("first", "s", 1)])
        fake.wait_calls("apply_deltas", 1)
        w.apply_deltas(deltas(10, "fill"))  # exactly fills the buffer
        returned = threading.Event()

        def produce() -> None:
            w.apply_deltas(deltas(3, "late"))
            returned.set()

        producer = threading.Thread(target=produce)
        producer.start()
        wait_state(w, lambda: w._blocked == 1)
        assert not returned.is_set()
        gate.set()
        producer.join()
        assert returned.is_set()
        w.flush()
    client.close()
    assert fake.applied == [("first", "s", 1), *deltas(10, "fill"), *deltas(3, "late")]
    assert w.health().dropped == 0


def test_not_found_on_a_batch_is_a_lost_lease(
    client: Client, fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("apply_deltas", tally.NotFound("unknown writer handle"))
    gate = fake.hold("apply_deltas")
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(2, "a"))
    fake.wait_calls("apply_deltas", 1)
    w.apply_deltas(deltas(4, "b"))
    with caplog.at_level(logging.ERROR, logger="tally"):
        gate.set()
        with pytest.raises(tally.LeaseLost) as info:
            w.flush()
    assert isinstance(info.value, tally.NotFound) and info.value.code is StatusCode.NOT_FOUND
    record = next(r for r in caplog.records if "lost its lease" in r.getMessage())
    assert record.levelno == logging.ERROR and "discarding 6 buffered deltas" in record.getMessage()
    health = w.health()
    assert health.lease_lost and not health.open and health.buffered == 0 and health.dropped == 6
    for thread in w._threads:  # a lost lease ends the background threads without close()
        thread.join(10)
        assert not thread.is_alive()
    w.apply_deltas([("after", "s", 1)])  # never raises, counted
    assert w.health().dropped == 7
    with pytest.raises(tally.LeaseLost):
        w.close()
    with pytest.raises(tally.LeaseLost):
        w.close()  # idempotent: the same outcome
    assert fake.applied == [] and "close_writer" not in fake.calls


def test_not_found_on_a_heartbeat_is_a_lost_lease(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTransport(lease_ttl_s=0.03)  # heartbeat every 10 ms
    fake.fail("keep_alive", tally.Unavailable("blip"), tally.NotFound("lease expired"))
    client = make_client(fake)
    w = client.writer("cp")
    with caplog.at_level(logging.WARNING, logger="tally"):
        w.open()
        wait_state(w, lambda: w._core.lease_lost)
    assert fake.count("keep_alive") == 2
    assert any("lost its lease" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    with pytest.raises(tally.LeaseLost, match="lost its lease"):
        w.flush()
    with pytest.raises(tally.LeaseLost):
        w.close()
    client.close()
    assert no_tally_threads()


def test_a_heartbeat_that_crosses_its_writers_close_is_no_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A keep-alive on the wire while the writer closes comes back NOT_FOUND (the close ended the
    session there): the close went through, nothing was lost, and nothing may say a lease was. Seen
    with 1,000 writers closing at once (bench/dashboard.py): a fifth of them logged a lost lease."""
    fake = FakeTransport(lease_ttl_s=0.03)
    beat = fake.hold("keep_alive")  # the first heartbeat waits on the wire
    client = make_client(fake)
    w = client.writer("cp")
    w.open()
    fake.wait_calls("keep_alive", 1)
    fake.fail("keep_alive", tally.NotFound("writer handle 'h-1' is not open"))
    closing = fake.hold("close_writer")
    closed: list[tally.CloseResult] = []
    with caplog.at_level(logging.WARNING, logger="tally"):
        closer = threading.Thread(target=lambda: closed.append(w.close()))
        closer.start()
        fake.wait_calls("close_writer", 1)
        beat.set()  # the heartbeat's answer arrives while the close is out
        wait_state(w, lambda: w._core.next_heartbeat() is None)
        closing.set()
        closer.join(WAIT_S)
    assert not closer.is_alive() and len(closed) == 1 and closed[0].incomplete_count == 1
    assert not w.health().lease_lost
    assert not [r for r in caplog.records if "lease" in r.getMessage()]
    assert fake.count("keep_alive") == 1
    client.close()
    assert no_tally_threads()


def test_heartbeats_renew_the_lease_until_close() -> None:
    fake = FakeTransport(lease_ttl_s=0.03)
    client = make_client(fake)
    with client.writer("cp") as w:
        fake.wait_calls("keep_alive", 3)
        assert w.lease_ttl_s == pytest.approx(0.03)
        assert not w.health().lease_lost
    client.close()
    assert no_tally_threads()


@pytest.mark.parametrize(
    "error", [tally.InvalidArgument("id too long"), tally.ResourceExhausted("batch too big")]
)
def test_refused_batch_stops_the_writer_and_surfaces_on_flush_and_close(
    client: Client, fake: FakeTransport, error: tally.TallyError, caplog: pytest.LogCaptureFixture
) -> None:
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(3, "ok"))
    w.flush()
    fake.fail("apply_deltas", error)
    with caplog.at_level(logging.ERROR, logger="tally"):
        w.apply_deltas(deltas(3, "bad"))
        with pytest.raises(type(error), match=error.message):
            w.flush()
    assert any("refused batch" in r.getMessage() for r in caplog.records)
    w.apply_deltas(deltas(3, "later"))  # not sent: skipping the refused batch could fake a completion
    with pytest.raises(type(error)):
        w.flush()
    with pytest.raises(type(error)):
        w.close()
    assert fake.applied == deltas(3, "ok")
    assert "close_writer" in fake.calls  # the server-side writer is still closed cleanly
    assert w.health().last_error == f"{error.code.value}: {error.message}"


def test_invalid_input_never_raises_but_stops_the_writer_after_earlier_deltas(
    client: Client, fake: FakeTransport
) -> None:
    class NumpyLikeInt:
        def __index__(self) -> int:
            return 2

    w = client.writer("cp")
    w.open()
    w.apply_deltas([("a", "s", NumpyLikeInt())])  # type: ignore[list-item]
    w.apply_deltas([("b", "s", True)])  # bool is refused
    w.apply_deltas([("c", "s", 1)])
    with pytest.raises(tally.InvalidArgument, match=r"deltas\[0\]"):
        w.flush()
    assert fake.applied == [("a", "s", 2)]
    w.apply_deltas(None)  # type: ignore[arg-type]
    w.apply_deltas([("x",)])  # type: ignore[list-item]
    with pytest.raises(tally.InvalidArgument):
        w.close()


def test_close_is_idempotent_and_later_calls_are_refused_or_dropped(
    client: Client, fake: FakeTransport
) -> None:
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(4))
    first = w.close()
    assert w.close() is first
    assert first.counts.applied == 4 and first.incomplete_sources == ("s9",) and first.incomplete_count == 1
    assert fake.count("close_writer") == 1
    w.apply_deltas(deltas(1, "late"))
    assert w.health().dropped == 1 and not w.health().open
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        w.flush()
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        w.open()


def test_close_delivers_the_buffer_first(client: Client, fake: FakeTransport) -> None:
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(250))
    w.close()
    assert fake.applied == deltas(250)
    assert fake.calls.index("close_writer") > max(i for i, c in enumerate(fake.calls) if c == "apply_deltas")


def test_close_timeout_discards_the_buffer_and_raises_unavailable(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("apply_deltas", *[tally.Unavailable("down")] * 100_000)
    client = make_client(fake, retry_initial_s=0.01, retry_max_s=0.01)
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(3))
    with (
        caplog.at_level(logging.ERROR, logger="tally"),
        pytest.raises(tally.Unavailable, match="close timed out"),
    ):
        w.close(timeout=0.05)
    assert w.health().dropped == 3 and w.health().buffered == 0
    # Still closed on the coordinator, so the writer id is free now rather than after its lease.
    assert fake.count("close_writer") == 1
    client.close()
    assert no_tally_threads()


def test_close_timeout_still_raises_when_the_coordinator_cannot_close_either(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("apply_deltas", *[tally.Unavailable("down")] * 100_000)
    fake.fail("close_writer", *[tally.Unavailable("down")] * 100_000)
    client = make_client(fake, retry_initial_s=0.01, retry_max_s=0.01, timeout=0.2)
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(3))
    with (
        caplog.at_level(logging.WARNING, logger="tally"),
        pytest.raises(tally.Unavailable, match="close timed out"),
    ):
        w.close(timeout=0.05)
    assert fake.count("close_writer") >= 1  # retried within the grace (the client's timeout here)
    assert any("stays live there until its lease expires" in r.getMessage() for r in caplog.records)
    client.close()
    assert no_tally_threads()


def test_context_manager_closes_when_the_body_raises(client: Client, fake: FakeTransport) -> None:
    with pytest.raises(RuntimeError, match="boom"), client.writer("cp") as w:
        w.apply_deltas(deltas(3))
        raise RuntimeError("boom")
    assert fake.applied == deltas(3)  # progress made before the error is real: delivered
    assert fake.count("close_writer") == 1
    assert not w.health().open


def test_close_error_does_not_mask_the_body_exception(
    client: Client, fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("close_writer", tally.Internal("disk full"))
    with caplog.at_level(logging.ERROR, logger="tally"), pytest.raises(RuntimeError, match="boom"):
        with client.writer("cp"):
            raise RuntimeError("boom")
    assert any("disk full" in r.getMessage() for r in caplog.records)


def test_close_error_propagates_from_a_clean_body(client: Client, fake: FakeTransport) -> None:
    fake.fail("close_writer", tally.Internal("disk full"))
    with pytest.raises(tally.Internal, match="disk full"), client.writer("cp"):
        pass


def test_flush_rpc_not_found_is_a_lost_lease(client: Client, fake: FakeTransport) -> None:
    fake.fail("flush", tally.NotFound("gone"))
    w = client.writer("cp")
    w.open()
    with pytest.raises(tally.LeaseLost):
        w.flush()
    assert w.health().lease_lost
    with pytest.raises(tally.LeaseLost):
        w.close()


def test_flush_and_close_rpcs_retry_unavailable(client: Client, fake: FakeTransport) -> None:
    fake.fail("flush", tally.Unavailable("blip"))
    fake.fail("close_writer", tally.Unavailable("blip"))
    with client.writer("cp") as w:
        w.flush()
    assert fake.count("flush") == 2 and fake.count("close_writer") == 2


def test_open_sends_identity_and_defaults(
    client: Client, fake: FakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "8")
    w = client.writer("cp", fingerprint={"pipeline": "h1"}, labels={"team": "x", "slurm_job_id": "override"})
    assert w.handle is None and w.completed_at_open is None and w.lease_ttl_s is None
    fake.completed.update({"a", "b"})
    with w:
        spec = fake.specs[0]
        assert spec.writer_id == f"{socket.gethostname()}-{os.getpid()}" == w.writer_id
        assert spec.host == socket.gethostname() and spec.pid == os.getpid()
        assert spec.fingerprint == {"pipeline": "h1"}
        assert spec.labels == {
            "team": "x",
            "slurm_job_id": "override",
            "slurm_array_task_id": "3",
            "slurm_array_task_count": "8",
        }
        assert w.handle == "h-1" and w.completed_at_open == 2 and w.lease_ttl_s == 30.0
        w.open()  # idempotent while open
    assert fake.count("open_writer") == 1


def test_open_retries_unavailable_and_raises_refusals(client: Client, fake: FakeTransport) -> None:
    fake.fail("open_writer", tally.Unavailable("starting up"))
    with client.writer("cp", writer_id="w1") as w:
        assert w.writer_id == "w1"
    fake.fail("open_writer", tally.AlreadyExists("writer 'w1' is live"))
    with pytest.raises(tally.AlreadyExists, match="is live"), client.writer("cp", writer_id="w1"):
        pass


def test_writer_are_completed_needs_no_open_writer(client: Client, fake: FakeTransport) -> None:
    fake.completed.add("s1")
    w = client.writer("cp")
    assert w.are_completed(["s0", "s1"]) == [False, True]
    with pytest.raises(tally.FailedPrecondition, match="not open"):
        w.flush()
    assert w.close() == tally.CloseResult()


def test_settle_window_warning_when_flush_interval_is_too_long(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTransport(settle_ms=50)
    client = make_client(fake, flush_interval_s=0.04)
    with caplog.at_level(logging.WARNING, logger="tally"), client.writer("cp"):
        pass
    client.close()
    assert any("settle" in r.getMessage() for r in caplog.records)


def test_transport_bug_stops_the_writer_visibly(client: Client, fake: FakeTransport) -> None:
    def broken(*args: object) -> None:
        raise KeyError("bug")

    fake.apply_deltas = broken  # type: ignore[assignment,method-assign]
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(1))
    with pytest.raises(tally.Internal, match="bug"):
        w.flush()
    with pytest.raises(tally.Internal):
        w.close()


def test_client_close_closes_open_writers(fake: FakeTransport) -> None:
    client = make_client(fake)
    w = client.writer("cp")
    w.open()
    w.apply_deltas(deltas(2))
    client.close()
    assert fake.applied == deltas(2) and fake.count("close_writer") == 1 and fake.closed
    assert not w.health().open
    client.close()  # idempotent
    assert no_tally_threads()


def test_a_crashed_background_thread_stops_the_writer_visibly(
    client: Client, fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    w = client.writer("cp")

    def crash(batch: object) -> None:
        raise RuntimeError("sender bug")

    w._send = crash  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="tally"):
        w.open()
        w.apply_deltas(deltas(2))
        with pytest.raises(tally.Internal, match="sender bug"):
            w.flush()
    assert any("crashed" in r.getMessage() for r in caplog.records)
    with pytest.raises(tally.Internal):
        w.close()

"""The writer's core on its own: events in, decisions out, a fake clock. No threads, no sleeps."""

from __future__ import annotations

import pytest

import tally
from tally._calls import BatchAnswer
from tally._config import ClientConfig
from tally._retry import RetryPolicy
from tally._types import ApplyCounts, OpenedWriter
from tally._writer.core import Batch, Wait, WriterCore
from tests.unit.client.tally_fakes import deltas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


CONFIG = ClientConfig(
    address="fake:1",
    max_batch=10,
    max_buffered=25,
    flush_interval_s=0.05,
    retry_initial_s=0.1,
    retry_max_s=0.4,
)


def open_core(clock: Clock, ttl: float = 30.0, allowed: int = 1, **overrides: object) -> WriterCore:
    """An open core; ``allowed``: the batches the coordinator lets it have on the wire at once."""
    config = ClientConfig(**{**CONFIG.__dict__, **overrides})  # type: ignore[arg-type]
    core = WriterCore(
        "w1", "cp", config, clock, RetryPolicy(config.retry_initial_s, config.retry_max_s, jitter=0)
    )
    assert core.begin_open()
    core.open_done(OpenedWriter("h1", "w1", ttl, 0, 250, max_batches_in_flight=allowed))
    return core


def take(core: WriterCore) -> Batch:
    step = core.next_send()
    assert isinstance(step, Batch), step
    return step


def test_a_lone_delta_lingers_for_the_flush_interval_then_goes() -> None:
    clock = Clock()
    core = open_core(clock)
    assert core.next_send() == Wait(None)  # nothing buffered: sleep until woken
    assert core.accept([("t", "s", 1)], 0, may_wait=True) == (1, True)  # wakes the sender
    assert core.next_send() == Wait(pytest.approx(0.05))
    clock.now += 0.03
    assert core.next_send() == Wait(pytest.approx(0.02))
    assert core.accept([("u", "s", 1)], 0, may_wait=True) == (1, False)  # no news for the sender
    clock.now += 0.021
    batch = take(core)
    assert (batch.seq, batch.deltas) == (1, [("t", "s", 1), ("u", "s", 1)])
    assert core.next_send() == Wait(None)  # in flight: the answer wakes the sender


def test_a_full_batch_goes_at_once_and_seqs_count_up() -> None:
    core = open_core(Clock())
    core.accept(deltas(25), 0, may_wait=True)
    first = take(core)
    core.batch_ok(first, BatchAnswer(ApplyCounts(applied=10)))
    second = take(core)
    core.batch_ok(second, BatchAnswer(ApplyCounts(applied=10)))
    assert [len(first.deltas), len(second.deltas)] == [10, 10] and (first.seq, second.seq) == (1, 2)
    assert isinstance(core.next_send(), Wait)  # 5 left: they linger
    assert core.health().buffered == 5 and core.health().batches_sent == 2


def test_an_unavailable_batch_is_resent_unchanged_with_its_seq_after_the_backoff() -> None:
    clock = Clock()
    core = open_core(clock)
    core.accept(deltas(10, "a"), 0, may_wait=True)
    batch = take(core)
    core.accept(deltas(10, "b"), 0, may_wait=True)  # later deltas wait behind the batch in flight
    for attempt, backoff in enumerate([0.1, 0.2, 0.4, 0.4], start=1):
        core.batch_failed(batch, tally.Unavailable("connection refused"))
        assert core.next_send() == Wait(pytest.approx(backoff))
        clock.now += backoff
        again = take(core)
        assert again is batch and again.seq == 1 and again.deltas == deltas(10, "a")
        assert core.retries == attempt
    core.batch_ok(batch, BatchAnswer(ApplyCounts(applied=10)))
    later = take(core)
    assert (later.seq, later.deltas) == (2, deltas(10, "b"))
    assert core.last_error == "UNAVAILABLE: connection refused"


def test_flush_ends_the_linger_and_its_barrier_counts_acknowledged_deltas() -> None:
    core = open_core(Clock())
    core.accept(deltas(3), 0, may_wait=True)
    target = core.begin_flush()
    assert target == 3 and not core.barrier_reached(target)
    batch = take(core)  # no linger: a flush is waiting
    assert not core.barrier_reached(target)
    core.batch_ok(batch, BatchAnswer(ApplyCounts(applied=3)))
    assert core.barrier_reached(target)
    core.raise_if_stopped()  # nothing went wrong


def test_a_batch_whose_sending_thread_was_interrupted_goes_again_at_once_without_a_retry() -> None:
    clock = Clock()
    core = open_core(clock)
    core.accept(deltas(3), 0, may_wait=True)
    core.begin_flush()
    batch = take(core)  # a flush sends it from its own thread
    assert core.next_send() == Wait(None)  # the sender thread leaves it alone meanwhile
    core.batch_interrupted(batch)  # e.g. KeyboardInterrupt in the flushing thread
    again = take(core)
    assert again is batch and again.seq == 1
    assert core.retries == 0
    core.batch_interrupted(Batch(9, deltas(1)))  # not the batch in flight: nothing changes
    assert core.next_send() == Wait(None)


def test_a_flush_needs_no_call_only_when_the_latest_answer_covers_its_barrier() -> None:
    core = open_core(Clock())
    core.accept(deltas(3), 0, may_wait=True)
    target = core.begin_flush()
    assert not core.settled_through(target)  # nothing answered yet
    core.batch_ok(take(core), BatchAnswer(ApplyCounts(applied=3), settled=True))
    assert core.barrier_reached(target) and core.settled_through(target)
    # A later answer that is not settled (a source settling, a commit in flight) takes it back,
    # even for the earlier barrier: the coordinator must be asked.
    core.accept(deltas(2), 0, may_wait=True)
    later = core.begin_flush()
    core.batch_ok(take(core), BatchAnswer(ApplyCounts(applied=2), settled=False))
    assert not core.settled_through(target) and not core.settled_through(later)
    core.accept(deltas(1), 0, may_wait=True)
    last = core.begin_flush()
    core.batch_ok(take(core), BatchAnswer(ApplyCounts(applied=1), settled=True))
    assert core.settled_through(last)
    # Deltas accepted after that answer are not covered until their own answer says so.
    core.accept(deltas(1), 0, may_wait=True)
    assert not core.settled_through(core.begin_flush())


def test_one_batch_at_a_time_unless_the_coordinator_allows_more() -> None:
    for allowed, config_allows, expected in [(1, 2, 1), (2, 2, 2), (4, 2, 2), (2, 1, 1)]:
        core = open_core(Clock(), allowed=allowed, max_batches_in_flight=config_allows, max_buffered=50)
        core.accept(deltas(50), 0, may_wait=True)
        out = [take(core) for _ in range(expected)]
        assert core.next_send() == Wait(None)  # the rest wait for an answer
        assert [b.seq for b in out] == list(range(1, expected + 1))
        assert all(b.ordered == (expected > 1) for b in out)  # ordered only when several may travel
        assert core.apply_call("h1", out[0]).ordered == (expected > 1)


def test_batches_in_flight_are_done_in_their_order_whatever_order_their_answers_come_in() -> None:
    core = open_core(Clock(), allowed=2)
    core.accept(deltas(25), 0, may_wait=True)
    target = core.begin_flush()
    first, second = take(core), take(core)
    assert core.batch_ok(second, BatchAnswer(ApplyCounts(applied=10), settled=True)) == []
    assert core.done == 0 and core.health().buffered == 15  # not done until the first one is
    assert core.health().batches_sent == 1
    third = take(core)  # one slot is free again
    assert third.seq == 3 and len(third.deltas) == 5
    # Both done now, in the order they were applied (the trace records them so; replay needs it);
    # the later answer (the second's) says whether the writer was settled.
    done = core.batch_ok(first, BatchAnswer(ApplyCounts(applied=10), settled=False))
    assert done is not None and [b.seq for b in done] == [1, 2]
    assert core.done == 20 and core.settled_through(20)
    done = core.batch_ok(third, BatchAnswer(ApplyCounts(applied=5), settled=True))
    assert done is not None and [b.seq for b in done] == [3]
    assert core.barrier_reached(target) and core.settled_through(target)
    assert core.batch_ok(third, BatchAnswer(ApplyCounts(applied=5))) is None  # answered already


def test_a_failed_batch_goes_again_alone_once_the_batches_after_it_are_answered() -> None:
    clock = Clock()
    core = open_core(clock, allowed=2)
    core.accept(deltas(25), 0, may_wait=True)
    first, second = take(core), take(core)
    core.batch_failed(first, tally.Unavailable("connection reset"))
    assert core.next_send() == Wait(None)  # the second is still out: nothing may pass it
    core.batch_failed(second, tally.Unavailable("connection reset"))
    assert core.next_send() == Wait(pytest.approx(0.1))  # the first's own backoff
    clock.now += 0.1
    assert take(core) is first
    assert core.next_send() == Wait(None)  # alone: the second waits for the first's answer
    core.batch_ok(first, BatchAnswer(ApplyCounts(applied=10)))
    assert core.done == 10
    clock.now += 0.2
    assert take(core) is second and second.seq == 2
    third = take(core)  # no failed batch left: two at a time again
    assert third.seq == 3 and core.next_send() == Wait(None)
    core.batch_ok(second, BatchAnswer(ApplyCounts(applied=10)))
    assert core.done == 20 and core.retries == 2


def test_a_batch_answered_after_one_before_it_failed_waits_for_that_ones_resend() -> None:
    clock = Clock()
    core = open_core(clock, allowed=2)
    core.accept(deltas(20), 0, may_wait=True)
    target = core.begin_flush()
    first, second = take(core), take(core)
    core.batch_failed(first, tally.Unavailable("answer lost"))
    # The coordinator applied the second, so it applied the first too; its answer was lost.
    core.batch_ok(second, BatchAnswer(ApplyCounts(applied=10)))
    assert core.done == 0 and core.health().buffered == 10
    clock.now += 0.1
    assert take(core) is first  # answered again by the coordinator, not applied twice
    core.batch_ok(first, BatchAnswer(ApplyCounts(applied=10)))
    assert core.barrier_reached(target) and core.done == 20


def test_a_refused_batch_with_another_in_flight_stops_the_writer_and_drops_the_rest() -> None:
    core = open_core(Clock(), allowed=2)
    core.accept(deltas(25), 0, may_wait=True)
    first, second = take(core), take(core)
    core.batch_failed(first, tally.InvalidArgument("bad batch"))
    assert core.done == 25 and core.dropped == 25 and core.health().buffered == 0
    assert core.batch_ok(second, BatchAnswer(ApplyCounts(applied=10))) is None  # discarded
    with pytest.raises(tally.InvalidArgument):
        core.raise_if_stopped()


def test_not_found_on_a_batch_loses_the_lease_and_stops_everything() -> None:
    core = open_core(Clock())
    core.accept(deltas(12), 0, may_wait=True)
    target = core.begin_flush()
    batch = take(core)
    core.batch_failed(batch, tally.NotFound("unknown writer handle"))
    assert core.lease_lost and core.stopping
    assert core.next_send() is None and core.next_heartbeat() is None
    assert core.barrier_reached(target)  # flush must not wait for what was discarded
    health = core.health()
    assert (health.open, health.lease_lost, health.buffered, health.dropped) == (False, True, 0, 12)
    with pytest.raises(tally.LeaseLost, match="lost its lease") as info:
        core.raise_if_stopped()
    assert core.stop_error is not info.value  # each raise gets a fresh error
    assert core.accept(deltas(2), 0, may_wait=True) == (2, False)
    assert core.dropped == 14


def test_a_refused_batch_stops_the_writer_but_earlier_batches_stand() -> None:
    core = open_core(Clock())
    core.accept(deltas(20), 0, may_wait=True)
    first = take(core)
    core.batch_ok(first, BatchAnswer(ApplyCounts(applied=10)))
    second = take(core)
    core.batch_failed(second, tally.InvalidArgument("task id too long"))
    assert not core.lease_lost and core.dropped == 10 and core.batches_sent == 1
    with pytest.raises(tally.InvalidArgument, match="too long"):
        core.raise_if_stopped()
    assert core.accept(deltas(1), 0, may_wait=True) == (1, False) and core.dropped == 11


def test_a_full_buffer_asks_a_producer_to_wait_unless_it_must_not() -> None:
    core = open_core(Clock())
    items = deltas(30)
    assert core.accept(items, 0, may_wait=True) == (25, True)  # 25 fit; wait for room, sender woken
    take(core)  # ten leave the buffer
    assert core.accept(items, 25, may_wait=True) == (30, True)
    assert core.accepted == 30
    # On the event loop a producer cannot wait: the bound is exceeded rather than a delta dropped.
    assert core.accept(deltas(40, "x"), 0, may_wait=False)[0] == 40
    assert len(core.pending) == 60 and core.dropped == 0


def test_heartbeats_every_third_of_the_lease_and_sooner_after_a_blip() -> None:
    clock = Clock()
    core = open_core(clock, ttl=30.0)
    assert core.next_heartbeat() == pytest.approx(10.0)
    clock.now += 10.0
    assert core.next_heartbeat() == 0.0  # due now
    core.heartbeat_failed(tally.Unavailable("blip"))
    assert core.next_heartbeat() == pytest.approx(0.1)  # backoff, not a third of the lease
    core.heartbeat_failed(tally.Unavailable("blip"))
    assert core.next_heartbeat() == pytest.approx(0.2)
    core.heartbeat_ok(12.0)  # the coordinator may change the TTL
    assert core.lease.ttl_s == 12.0 and core.next_heartbeat() == pytest.approx(4.0)
    core.heartbeat_failed(tally.PermissionDenied("token revoked"))  # refused: keep the period
    assert core.next_heartbeat() == pytest.approx(4.0) and not core.lease_lost
    core.heartbeat_failed(tally.NotFound("lease expired"))
    assert core.lease_lost and core.next_heartbeat() is None


def test_a_heartbeat_not_found_while_closing_stops_the_beats_and_loses_no_lease() -> None:
    # The keep-alive crossed the writer's close, which ended the session on the coordinator.
    clock = Clock()
    core = open_core(clock, ttl=3.0)
    assert core.begin_close() == "h1"
    clock.now += 1.0
    assert core.next_heartbeat() == 0.0  # still beating while the close goes on
    core.heartbeat_failed(tally.NotFound("writer handle 'h1' is not open"))
    assert not core.lease_lost and core.last_error is None and core.stop_error is None
    assert core.next_heartbeat() is None
    core.raise_if_stopped()  # nothing to raise: the close's own answer decides


def test_heartbeats_keep_going_while_the_coordinator_is_unavailable() -> None:
    # What a coordinator restart looks like from here: many UNAVAILABLE in a row, never a lost lease.
    clock = Clock()
    core = open_core(clock, ttl=3.0)
    for _ in range(50):
        wait = core.next_heartbeat()
        assert wait is not None and wait <= 1.0
        clock.now += wait
        core.heartbeat_failed(tally.Unavailable("connection refused"))
    assert not core.lease_lost and core.next_heartbeat() == pytest.approx(0.4)


def test_close_stops_accepting_and_an_abandoned_close_discards_the_rest() -> None:
    core = open_core(Clock())
    core.accept(deltas(4), 0, may_wait=True)
    assert core.begin_close() == "h1"
    assert core.accept(deltas(1, "late"), 0, may_wait=True) == (1, False) and core.dropped == 1
    target = core.begin_flush()
    take(core)  # out, never answered
    err = core.close_abandoned(target, 0.5)
    assert "close timed out after 0.5s with 4 deltas not yet acknowledged" in err.message
    assert core.barrier_reached(target) and core.health().buffered == 0 and core.dropped == 5
    core.finish_close()
    assert core.next_send() is None and core.next_heartbeat() is None
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        core.require_handle("flush")


def test_lifecycle_refusals() -> None:
    core = WriterCore("w1", "cp", CONFIG, Clock())
    with pytest.raises(tally.FailedPrecondition, match="not open"):
        core.require_handle("flush")
    core.accept(deltas(3), 0, may_wait=True)  # before open: buffered, nothing drains it yet
    assert core.begin_close() is None and core.dropped == 3  # closed unopened
    core.finish_close()
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        core.begin_open()

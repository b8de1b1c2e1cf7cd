"""Several ``tally serve`` on a PostgreSQL store of several shards each own some (issue #11).

A store made with ``--store-shards N`` has N shards; each coordinator on it holds the shards
rendezvous hashing gives it among the live ones, applies their checkpoints' deltas and forwards every
other call to the shard's holder. Every server here is a real ``tally serve`` process on a fresh
database.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

import tally
from tally_server.store.postgres import store_url
from tally_server.store.shards import shard_of
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

pytestmark = pytest.mark.postgres

SHARDS = 4
TALLY = str(Path(sys.executable).parent / "tally")
_SERVING = re.compile(r"tally serving shard\(s\) (.*) of (\d+) of store")


def held(server: RunningServer) -> frozenset[int]:
    """The shards the server's latest service owns, as its log says."""
    lines = _SERVING.findall(server.log())
    if not lines:
        return frozenset()
    shards = lines[-1][0]
    return frozenset() if shards.startswith("(") else frozenset(int(s) for s in shards.split(", "))


def split(servers: list[RunningServer]) -> bool:
    """Every shard held by exactly one of ``servers``, each of which holds some."""
    sets = [held(s) for s in servers]
    return (
        all(sets) and sum(len(s) for s in sets) == SHARDS and frozenset().union(*sets) == set(range(SHARDS))
    )


def names_per_shard(prefix: str, per_shard: int = 2) -> list[str]:
    """Checkpoint names, ``per_shard`` of each shard."""
    found: dict[int, list[str]] = {s: [] for s in range(SHARDS)}
    i = 0
    while any(len(v) < per_shard for v in found.values()):
        name = f"{prefix}/{i}"
        bucket = found[shard_of(name, SHARDS)]
        if len(bucket) < per_shard:
            bucket.append(name)
        i += 1
    return [n for s in range(SHARDS) for n in found[s]]


def write_one(writers: dict[str, Any], source: str, rng: random.Random, done: dict[str, set[str]]) -> None:
    """``source`` through every writer: completed (and recorded in ``done``), or one time in five left
    pending (never completed)."""
    for name, w in writers.items():
        deltas = tree(source)
        if rng.random() < 0.2:
            w.apply_deltas(deltas[:2])
        else:
            w.apply_deltas(deltas)
            done[name].add(source)


def assert_as_modelled(client: tally.Client, name: str, asked: list[str], done: set[str]) -> None:
    """``name`` answers ``asked`` as the model says, its status counts ``done`` and no anomaly."""
    assert client.are_completed(name, asked) == [s in done for s in asked], name
    wait_until(
        lambda: client.checkpoint(name).completed_count == len(done), timeout=30, what=f"{name}'s status"
    )
    assert client.checkpoint(name).anomalies == 0


@contextlib.contextmanager
def sharded(tmp_path: Path, url: str, n: int, **options: object) -> Iterator[list[RunningServer]]:
    """``n`` coordinators on a new store of ``SHARDS`` shards, once the shards are split among them."""
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_server(tmp_path / f"c{i}", store=url, args=["--store-shards", str(SHARDS)], **options)  # type: ignore[arg-type]
            )
            for i in range(n)
        ]
        wait_until(
            lambda: split(servers), timeout=60, what=f"the {SHARDS} shards split among the coordinators"
        )
        yield servers


def listed_over_http(server: RunningServer, writers: bool = True) -> dict[str, dict[str, Any]]:
    """``GET /v1/checkpoints`` by name (``writers`` False: asked without the live writers)."""
    params = {} if writers else {"writers": "false"}
    reply = httpx.get(f"{server.http_url}/v1/checkpoints", params=params, timeout=10)
    reply.raise_for_status()
    return {c["name"]: c for c in reply.json()["checkpoints"]}


def test_two_coordinators_split_the_shards_and_either_answers_every_call(
    tmp_path: Path, postgres_url: str
) -> None:
    names = names_per_shard("split")
    with sharded(tmp_path, postgres_url, 2, settle_ms=0) as servers:
        first, second = servers
        owner_of = {shard: s for s in servers for shard in held(s)}
        with tally.Client(first.grpc_address) as client:
            for name in names:
                with client.writer(name, writer_id="w") as w:
                    for source in ("a", "b"):
                        w.apply_deltas(tree(source))
                    w.apply_deltas(tree("half")[:3])
                    w.flush()
        # Each checkpoint's deltas were applied by its shard's holder: its published owner.
        with tally.Client(second.grpc_address) as other:
            for name in names:
                assert other.are_completed(name, ["a", "b", "half"]) == [True, True, False]
                holder = owner_of[shard_of(name, SHARDS)]
                wait_until(
                    lambda name=name: other.checkpoint(name).completed_count == 2,  # type: ignore[misc]
                    timeout=30,
                    what=f"{name}'s status",
                )
                assert other.checkpoint(name).owner in holder.log()
            # The list, from either: its own checkpoints from memory, the other's as published.
            wait_until(
                lambda: {c.name for c in other.checkpoints()} == set(names),
                timeout=30,
                what="every checkpoint listed",
            )
        # Writers over HTTP through the second coordinator: their calls (handle in the path, the
        # checkpoint in the body) reach each shard's holder.
        with tally.Client(second.http_url) as over_http:
            for name in names:
                with over_http.writer(name, writer_id="w-http") as w:
                    w.apply_deltas(tree("c"))
                    w.flush()
                assert over_http.are_completed(name, ["a", "c", "half"]) == [True, True, False]
        # Who holds which shard, through either (gRPC, HTTP, the CLI in a pipe).
        with tally.Client(second.grpc_address) as other:
            listed = other.replicas()
        assert {r.grpc_address: frozenset(r.shards) for r in listed.replicas} == {
            s.grpc_address: held(s) for s in servers
        }
        assert all(r.owner for r in listed.replicas)
        over_http = httpx.get(f"{first.http_url}/v1/replicas").json()["replicas"]
        assert sorted(s for r in over_http for s in r["shards"]) == list(range(SHARDS))
        shown = subprocess.run(
            [TALLY, "replicas", "--address", first.grpc_address], capture_output=True, text=True, timeout=60
        ).stdout
        for server in servers:
            assert "owns " + ",".join(map(str, sorted(held(server)))) in shown, shown
        # Both applied deltas: the writes spread.
        assert {owner_of[shard_of(n, SHARDS)].grpc_address for n in names} == {
            s.grpc_address for s in servers
        }
        # Over HTTP, through the coordinator that does not hold the shard, and the list from either.
        for name in names:
            for server in servers:
                answer = httpx.post(
                    f"{server.http_url}/v1/are-completed",
                    json={"checkpoint": name, "source_ids": ["a", "zz"]},
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["completed"] == [True, False]
        for server in servers:
            wait_until(
                lambda server=server: (
                    {  # type: ignore[misc]
                        c["name"]
                        for c in httpx.get(f"{server.http_url}/v1/checkpoints").json()["checkpoints"]
                    }
                    == set(names)
                ),
                timeout=30,
                what="every checkpoint listed over HTTP",
            )
        # A live writer on each: every listing counts it, where it is served from memory (the holder)
        # and where it comes from the published status (the other); asked without writers, none is
        # listed, by either.
        with tally.Client(first.grpc_address) as client:
            live = [client.writer(name, writer_id="live") for name in names]
            for writer in live:
                writer.__enter__()
            try:
                for server in servers:
                    wait_until(
                        lambda server=server: all(  # type: ignore[misc]
                            c["live_writers"] == 1 for c in listed_over_http(server).values()
                        ),
                        timeout=30,
                        what="every live writer listed",
                    )
                    full = listed_over_http(server)
                    assert {n: [w["writer_id"] for w in c["writers"]] for n, c in full.items()} == {
                        n: ["live"] for n in names
                    }
                    bare = listed_over_http(server, writers=False)
                    assert {n: (c["live_writers"], c["writers"]) for n, c in bare.items()} == {
                        n: (1, []) for n in names
                    }
            finally:
                for writer in live:
                    writer.__exit__(None, None, None)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_shards_move_to_a_joining_coordinator_and_back_when_it_goes_and_nothing_is_lost(
    tmp_path: Path, postgres_url: str, how: signal.Signals
) -> None:
    """Writers on every shard; a second coordinator joins (shards handed over), then goes: the model's set."""
    rng = random.Random(11)
    names = names_per_shard("move", per_shard=1)
    sources = [f"s{i:03d}" for i in range(60)]
    done: dict[str, set[str]] = {n: set() for n in names}
    options = {"settle_ms": 0, "lease_ttl_s": 60, "args": ["--store-shards", str(SHARDS)]}
    with running_server(tmp_path / "c0", store=postgres_url, **options) as first:  # type: ignore[arg-type]
        wait_until(
            lambda: held(first) == set(range(SHARDS)), timeout=60, what="the first to hold every shard"
        )
        second_started = contextlib.ExitStack()
        with second_started:
            with tally.Client(first.grpc_address, timeout=120) as client:
                writers = {n: client.writer(n, writer_id=f"w-{i}") for i, n in enumerate(names)}
                for w in writers.values():
                    w.__enter__()
                for i, source in enumerate(sources):
                    if i == 20:
                        for w in writers.values():
                            w.flush()
                        second = second_started.enter_context(
                            running_server(tmp_path / "c1", store=postgres_url, **options)  # type: ignore[arg-type]
                        )
                        pair = [first, second]
                        wait_until(functools.partial(split, pair), timeout=60, what="the shards handed over")
                    if i == 40:
                        for w in writers.values():
                            w.flush()
                        second.process.send_signal(how)
                        second.process.wait(60)
                    write_one(writers, source, rng, done)
                for w in writers.values():
                    w.flush()
                for name in names:
                    assert client.are_completed(name, sources) == [s in done[name] for s in sources], name
                for w in writers.values():
                    w.__exit__(None, None, None)
                wait_until(lambda: held(first) == set(range(SHARDS)), timeout=60, what="every shard back")
                for name in names:
                    assert_as_modelled(client, name, sources, done[name])


def test_a_survivor_adopts_a_killed_coordinators_shards_and_its_own_writer_notices_nothing(
    tmp_path: Path, postgres_url: str
) -> None:
    """A writer through each of two coordinators, on that coordinator's own shard; one is killed
    (-9) while both write. The survivor adopts its shards into its running service (no restart):
    its own writer sees no refusal at all, the killed one's re-attaches through it from the journal,
    and the final sets are the model's."""
    rng = random.Random(3)
    sources = (f"s{i:05d}" for i in itertools.count())
    with sharded(tmp_path, postgres_url, 2, settle_ms=0, lease_ttl_s=60) as (killed, survivor):
        names = names_per_shard("adopt", per_shard=1)
        theirs = next(n for n in names if shard_of(n, SHARDS) in held(killed))
        mine = next(n for n in names if shard_of(n, SHARDS) in held(survivor))
        done: dict[str, set[str]] = {theirs: set(), mine: set()}
        written: list[str] = []

        def write() -> None:
            written.append(next(sources))
            write_one(writers, written[-1], rng, done)

        with contextlib.ExitStack() as stack:
            both = f"{killed.grpc_address},{survivor.grpc_address}"
            their_client = stack.enter_context(tally.Client(both, timeout=120))
            my_client = stack.enter_context(tally.Client(survivor.grpc_address, timeout=120))
            writers = {
                theirs: stack.enter_context(their_client.writer(theirs, writer_id="w-killed")),
                mine: stack.enter_context(my_client.writer(mine, writer_id="w-survivor")),
            }
            own = writers[mine]
            for _ in range(20):
                write()
            for w in writers.values():
                w.flush()
            killed.process.send_signal(signal.SIGKILL)
            killed.process.wait(60)
            # Both write on, the survivor's own writer flushing each batch, while the survivor
            # takes the killed one's shards over.
            deadline = time.monotonic() + 60
            while held(survivor) != set(range(SHARDS)):
                assert time.monotonic() < deadline, "timed out waiting for the survivor to hold every shard"
                write()
                own.flush(timeout=120)
            for _ in range(20):
                write()
            for w in writers.values():
                w.flush(timeout=120)
            log = survivor.log()
            adopted = r"adopted shard\(s\) [\d, ]+ of the store into the running service \(1 writer"
            assert re.search(adopted, log), log
            assert "restarting its service" not in log
            # Not one refusal, of a batch or a heartbeat, reached the survivor's own writer.
            health = own.health()
            assert (health.retries, health.last_error, health.lease_lost) == (0, None, False)
            # The killed one's writer was refused while its shard moved, and carried on through the
            # survivor under the same lease (restored from the journal).
            theirs_health = writers[theirs].health()
            assert theirs_health.retries > 0 and not theirs_health.lease_lost
        with tally.Client(survivor.grpc_address) as client:
            for name in (theirs, mine):
                assert_as_modelled(client, name, written, done[name])


def test_a_coordinator_hands_shards_over_in_place_and_the_writers_of_those_it_keeps_notice_nothing(
    tmp_path: Path, postgres_url: str
) -> None:
    """One coordinator holds every shard, a writer on each writing (and flushing every batch) on a
    thread of its own through it; a second one joins and is handed its share in place (no
    restart): the writers of the shards kept, writing all along, see not one refusal, those of the
    shards handed over re-attach through the new holder from the journal, and the final sets are
    the model's."""
    names = names_per_shard("handover", per_shard=1)
    done: dict[str, set[str]] = {n: set() for n in names}
    written: dict[str, list[str]] = {n: [] for n in names}
    health: dict[str, Any] = {}
    failures: list[BaseException] = []
    stop = threading.Event()
    options = {"settle_ms": 0, "lease_ttl_s": 60, "args": ["--store-shards", str(SHARDS)]}

    def work(first: RunningServer, i: int, name: str) -> None:
        rng = random.Random(i)
        try:
            with tally.Client(first.grpc_address, timeout=120) as client:
                with client.writer(name, writer_id=f"w-{i}") as w:
                    while not stop.is_set():
                        source = f"s{len(written[name]):05d}"
                        complete = rng.random() >= 0.2  # one in five left pending (never completed)
                        deltas = tree(source)
                        w.apply_deltas(deltas if complete else deltas[:2])
                        w.flush(timeout=120)
                        written[name].append(source)
                        if complete:
                            done[name].add(source)
                    health[name] = w.health()
        except BaseException as exc:  # the main thread says so
            failures.append(exc)

    def wrote(at_least: dict[str, int]) -> bool:
        assert not failures, failures
        return all(len(written[n]) >= at_least[n] for n in names)

    with running_server(tmp_path / "a", store=postgres_url, **options) as first:  # type: ignore[arg-type]
        wait_until(
            lambda: held(first) == set(range(SHARDS)), timeout=60, what="the first to hold every shard"
        )
        threads = [threading.Thread(target=work, args=(first, i, n)) for i, n in enumerate(names)]
        with contextlib.ExitStack() as stack:
            for thread in threads:
                thread.start()
            try:
                wait_until(
                    lambda: wrote({n: 20 for n in names}), timeout=60, what="20 batches by each writer"
                )
                second = stack.enter_context(running_server(tmp_path / "b", store=postgres_url, **options))  # type: ignore[arg-type]
                wait_until(lambda: split([first, second]), timeout=60, what="the shards handed over")
                now = {n: len(written[n]) + 20 for n in names}
                wait_until(lambda: wrote(now), timeout=120, what="20 more batches by each writer")
            finally:
                stop.set()
                for thread in threads:
                    thread.join(180)
            assert not failures, failures
            kept, moved = held(first), held(second)
            moved_names = [n for n in names if shard_of(n, SHARDS) in moved]
            assert kept | moved == set(range(SHARDS)) and kept and moved_names
            # The first gave the moved shards up in place, every writer of theirs left in the journal,
            # and the second adopted them, restoring those writers; neither restarted its service.
            log = first.log()
            handed = re.findall(
                r"handed shard\(s\) [\d, ]+ of the store over in place \((\d+) writers? left", log
            )
            adopted = re.findall(
                r"adopted shard\(s\) [\d, ]+ of the store into the running service \((\d+) writers? from",
                second.log(),
            )
            assert sum(map(int, handed)) == sum(map(int, adopted)) == len(moved_names), (handed, adopted)
            assert "restarting its service" not in log + second.log()
            for name in names:
                h = health[name]
                if name in moved_names:  # refused while its shard moved, then on through the new holder
                    assert h.retries > 0 and not h.lease_lost, (name, h)
                else:  # not one refusal, of a batch, a flush or a heartbeat, while it wrote all along
                    assert (h.retries, h.last_error, h.lease_lost) == (0, None, False), (name, h)
            # Through the first coordinator, the second one still holding its share.
            with tally.Client(first.grpc_address) as client:
                for name in names:
                    assert_as_modelled(client, name, written[name], done[name])
                for name in moved_names:  # published by the second, which applied their deltas
                    assert client.checkpoint(name).owner in second.log(), name
            assert held(first) == kept and held(second) == moved


def test_a_store_keeps_the_number_of_shards_it_was_made_with(tmp_path: Path, postgres_url: str) -> None:
    with running_server(tmp_path / "c0", store=postgres_url, args=["--store-shards", "3"]) as first:
        wait_until(lambda: held(first) == {0, 1, 2}, timeout=60, what="the store made with 3 shards")
    with pytest.raises(RuntimeError) as refused:
        with running_server(
            tmp_path / "c1", store=postgres_url, args=["--store-shards", "5"], startup_timeout=30
        ):
            pass
    message = str(refused.value)
    assert "3 shards" in message and "--store-shards 3" in message
    # Without the option, the store's own number.
    with running_server(tmp_path / "c2", store=postgres_url) as again:
        wait_until(lambda: held(again) == {0, 1, 2}, timeout=60, what="the store's 3 shards")


def test_a_paused_coordinators_shards_are_taken_over_and_it_writes_nothing_once_resumed(
    tmp_path: Path, postgres_url: str
) -> None:
    """SIGSTOP keeps the paused one's lock sessions: the other ends them and takes its shards;
    resumed, the paused one finds its shards' epochs moved on and drops them in place, then gets
    its share back, handed over in place."""
    with sharded(tmp_path, postgres_url, 2, settle_ms=0, lease_ttl_s=60) as (paused, other):
        mine = held(paused)
        (name,) = [n for n in names_per_shard("pause", per_shard=1) if shard_of(n, SHARDS) in mine][:1]
        sources = [f"s{i}" for i in range(30)]
        # The writer goes through the other coordinator, which forwards to the paused one's shard.
        with tally.Client(other.grpc_address, timeout=120) as client, client.writer(name, writer_id="w") as w:
            for source in sources[:15]:
                w.apply_deltas(tree(source))
            w.apply_deltas(tree("half")[:3])
            w.flush()
            paused.process.send_signal(signal.SIGSTOP)
            try:
                wait_until(
                    lambda: held(other) == set(range(SHARDS)), timeout=60, what="every shard taken over"
                )
                for source in sources[15:]:
                    w.apply_deltas(tree(source))
                w.apply_deltas(tree("half")[3:])
                w.flush(timeout=120)
            finally:
                paused.process.send_signal(signal.SIGCONT)
            assert "has not shown it is alive" in other.log()
            # Resumed: its leases are found taken (their epochs moved on), it drops those shards from
            # its running service; alive again, it gets its share back, handed over by the other, in
            # place both (neither restarts its service).
            wait_until(
                lambda: "lost shard" in paused.log(), timeout=60, what="the paused one to see its loss"
            )
            wait_until(lambda: split([paused, other]), timeout=60, what="the shards split again")
            assert re.search(
                r"dropped the lost shard\(s\) [\d, ]+ of the store from the running", paused.log()
            )
            assert re.search(r"handed shard\(s\) [\d, ]+ of the store over in place", other.log())
            assert "restarting its service" not in paused.log() + other.log()
            more = [f"t{i}" for i in range(10)]
            for source in more:
                w.apply_deltas(tree(source))
            w.flush(timeout=120)
            assert not w.health().lease_lost
            everything = [*sources, "half", *more]
            assert client.are_completed(name, everything) == [True] * len(everything)
            wait_until(
                lambda: client.checkpoint(name).completed_count == len(everything),
                timeout=30,
                what="the status to show every completion",
            )
            assert client.checkpoint(name).anomalies == 0


def test_a_coordinator_paused_inside_a_commit_still_has_its_shard_taken_over(
    tmp_path: Path, postgres_url: str
) -> None:
    """A commit reads its shard's epoch FOR KEY SHARE and holds that lock until it commits; a
    coordinator paused between the two keeps it, and the takeover's epoch bump waited behind it for
    ever (a full CI run once timed out so). The session holding the lock here stands in for the paused
    one's commit session: the takeover ends it, and its uncommitted transaction with it."""
    with sharded(tmp_path, postgres_url, 2, settle_ms=0, lease_ttl_s=60) as (paused, other):
        shard = min(held(paused))
        engine = sa.create_engine(store_url(postgres_url), poolclass=sa.pool.NullPool)
        try:
            conn = engine.connect()
            conn.execute(sa.text(f"SELECT epoch FROM store_epoch WHERE id = {shard + 1} FOR KEY SHARE"))
            paused.process.send_signal(signal.SIGSTOP)
            try:
                wait_until(
                    lambda: held(other) == set(range(SHARDS)), timeout=60, what="every shard taken over"
                )
                assert "ending a session still holding its epoch row" in other.log()
                with pytest.raises(sa.exc.OperationalError):  # ended: its transaction rolled back
                    conn.execute(sa.text("SELECT 1"))
            finally:
                paused.process.send_signal(signal.SIGCONT)
                conn.invalidate()
                conn.close()
        finally:
            engine.dispose()
        wait_until(lambda: split([paused, other]), timeout=60, what="the shards split again")


def test_three_coordinators_one_killed_one_stopped_writers_on_each_lose_nothing(
    tmp_path: Path, postgres_url: str
) -> None:
    """Issue #11's scenario on a store of shards: writers through each of three coordinators, one
    coordinator killed (-9) midway and another stopped (SIGTERM) later; the final sets are the model's."""
    rng = random.Random(5)
    sources = [f"s{i:03d}" for i in range(45)]
    with sharded(tmp_path, postgres_url, 3, settle_ms=0, lease_ttl_s=60) as servers:
        names = names_per_shard("three", per_shard=1)[:3]
        done: dict[str, set[str]] = {n: set() for n in names}
        with contextlib.ExitStack() as stack:
            writers = {}
            for i, name in enumerate(names):
                # Each writer's client lists every coordinator, starting with a different one.
                order = servers[i:] + servers[:i]
                client = stack.enter_context(
                    tally.Client(",".join(s.grpc_address for s in order), timeout=120)
                )
                writers[name] = stack.enter_context(client.writer(name, writer_id=f"w{i}"))
            for i, source in enumerate(sources):
                if i in (15, 30):
                    for w in writers.values():
                        w.flush()
                    gone = servers[0] if i == 15 else servers[1]
                    gone.process.send_signal(signal.SIGKILL if i == 15 else signal.SIGTERM)
                    gone.process.wait(60)
                write_one(writers, source, rng, done)
            for w in writers.values():
                w.flush()
                assert not w.health().lease_lost
        survivor = servers[2]
        wait_until(
            lambda: held(survivor) == set(range(SHARDS)), timeout=60, what="the survivor to hold every shard"
        )
        with tally.Client(survivor.grpc_address) as client:
            for name in names:
                assert client.are_completed(name, sources) == [s in done[name] for s in sources], name
                status = client.checkpoint(name)
                assert status.anomalies == 0


def test_the_writers_of_the_shards_kept_notice_nothing_while_a_shard_taken_is_still_in_the_fence(
    tmp_path: Path, postgres_url: str
) -> None:
    """A coordinator holding every shard; shard 2's epoch moves on (another coordinator's takeover)
    while shard 2 is still in its fence. Its writes are fenced by the shards they carry: writers on
    the other shards write and flush on, not one refusal among them, and every completion is durable.

    Deterministic by moving the epoch without ending the coordinator's lock session: its renewal
    notices a lost shard only by that session having ended (``StoreLock.check``), so shard 2 stays in
    its fence for the whole test, where a real takeover of a paused coordinator (SIGSTOP) is noticed
    by the first renewal after it resumes, racing the writers' first commits."""
    with running_server(
        tmp_path / "c", store=postgres_url, args=["--store-shards", str(SHARDS)], settle_ms=0, lease_ttl_s=60
    ) as server:
        wait_until(lambda: held(server) == set(range(SHARDS)), timeout=60, what="every shard held")
        names = [n for n in names_per_shard("kept", per_shard=1) if shard_of(n, SHARDS) != 2]
        sources = [f"s{i}" for i in range(20)]
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(tally.Client(server.grpc_address, timeout=30))
            writers = {
                n: stack.enter_context(client.writer(n, writer_id=f"w{i}")) for i, n in enumerate(names)
            }
            for source in sources[:10]:
                for w in writers.values():
                    w.apply_deltas(tree(source))
            for w in writers.values():
                w.flush()
            engine = sa.create_engine(store_url(postgres_url), poolclass=sa.pool.NullPool)
            try:
                with engine.begin() as conn:  # as another coordinator's takeover bumps it
                    moved = conn.execute(
                        sa.text("UPDATE store_epoch SET epoch = epoch + 1 WHERE id = 3 RETURNING epoch")
                    ).scalar_one()
            finally:
                engine.dispose()
            assert moved == 2
            for source in sources[10:]:
                for w in writers.values():
                    w.apply_deltas(tree(source))
                for w in writers.values():
                    w.flush(timeout=30)
            for name, w in writers.items():
                health = w.health()
                assert (health.retries, health.last_error, health.lease_lost) == (0, None, False), name
            for name in names:
                assert client.are_completed(name, sources) == [True] * len(sources), name
        assert "no longer owns shard" not in server.log()
        assert held(server) == set(range(SHARDS))  # shard 2 still in the fence all along

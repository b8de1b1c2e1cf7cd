"""Coordinators of a sharded PostgreSQL store killed, stopped and paused at random, writers on every shard.

Three ``tally serve`` share a fresh database as a store of 4 shards. Four writers, one checkpoint
per shard, each given the three addresses, stream source trees as in ``kill9`` (every tree split
across two rounds, a ``flush()`` ending each round), paced so that the stream lasts a while. Until
they end, a chaos loop picks a random coordinator and, at a random moment, either kill -9s it,
stops it with SIGTERM, or pauses it (SIGSTOP) past its shard leases and resumes it; a stopped one
is started again on its ports after a random pause. Checked at the end, through a coordinator:

- lost: a source acknowledged by a ``flush()`` that is not completed.
- false: a completed source whose whole tree was never queued.
- recovered: writers that finished their stream without being reopened.
- anomalies: every checkpoint's status must count none (a replayed delta after a failover would be
  one).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tally
from tally_server.store.shards import shard_of
from tally_server.testing import RunningServer

from .common import Row, port_of, scratch, serve
from .kill9 import CLIENT_TIMEOUT, WriterLog, plan_of, run_writer

SHARDS = 4
COORDINATORS = 3
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PAUSE_S = 1.0  # between a writer's rounds: the stream lasts about 12 rounds × this, and the stalls
PAUSED_S = 7.0  # a SIGSTOP lasts past the 5 s after which another coordinator takes the shards


@contextlib.contextmanager
def _database() -> Iterator[str | None]:
    """A fresh database on the local PostgreSQL (dropped afterwards), or None if it is not reachable."""
    import sqlalchemy as sa

    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    name = f"tally_fault_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError:
        admin.dispose()
        yield None
        return
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _checkpoints(trial: int) -> list[str]:
    """One checkpoint name per shard."""
    names: dict[int, str] = {}
    i = 0
    while len(names) < SHARDS:
        name = f"fault/shards-{trial}-{i}"
        names.setdefault(shard_of(name, SHARDS), name)
        i += 1
    return [names[s] for s in range(SHARDS)]


class _Cluster:
    """The coordinators, each restartable on its own ports and data dir."""

    def __init__(self, base: Path, url: str, settle_ms: int) -> None:
        self._base, self._url, self._settle_ms = base, url, settle_ms
        self._stack = contextlib.ExitStack()
        self.servers: list[RunningServer | None] = []
        self._contexts: list[contextlib.ExitStack] = []
        self.ports: list[tuple[int, int]] = []

    def start(self) -> None:
        for i in range(COORDINATORS):
            self._contexts.append(self._stack.enter_context(contextlib.ExitStack()))
            self.servers.append(None)
            self.ports.append((0, 0))
            self.up(i)

    def up(self, i: int) -> None:
        grpc_port, http_port = self.ports[i]
        server = self._contexts[i].enter_context(
            serve(
                self._base / f"c{i}",
                store=self._url,
                settle_ms=self._settle_ms,
                args=["--store-shards", str(SHARDS), "--replica-name", f"c{i}"],
                grpc_listen=f"127.0.0.1:{grpc_port}",
                http_listen=f"127.0.0.1:{http_port}",
            )
        )
        self.servers[i] = server
        self.ports[i] = (port_of(server.grpc_address), port_of(server.http_address))

    def down(self, i: int, how: str) -> None:
        server = self.servers[i]
        assert server is not None
        if how == "kill":
            server.kill()
        else:
            server.terminate()
        self._contexts[i].close()
        self.servers[i] = None

    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{grpc}" for grpc, _ in self.ports)

    def live(self) -> list[RunningServer]:
        return [s for s in self.servers if s is not None]

    def close(self) -> None:
        self._stack.close()


def _chaos(
    cluster: _Cluster, rng: random.Random, writers_done: threading.Event, acts: list[str], errors: list[str]
) -> None:
    """Until the writers are done: at random moments, kill -9, SIGTERM or pause a random coordinator."""
    try:
        _acts(cluster, rng, writers_done, acts)
    except Exception as exc:  # a coordinator that did not come back: the trial says so
        errors.append(f"{acts[-1] if acts else 'chaos'}: {exc}")


def _acts(cluster: _Cluster, rng: random.Random, writers_done: threading.Event, acts: list[str]) -> None:
    while not writers_done.wait(rng.uniform(0.5, 2.0)):
        i = rng.randrange(COORDINATORS)
        server = cluster.servers[i]
        assert server is not None
        how = rng.choice(("kill", "term", "pause"))
        acts.append(f"{how} c{i}")
        if how == "pause":
            server.process.send_signal(signal.SIGSTOP)
            writers_done.wait(PAUSED_S)
            server.process.send_signal(signal.SIGCONT)
            continue
        cluster.down(i, how)
        time.sleep(rng.uniform(0.0, 2.0))  # the random moment it comes back, not a synchronisation
        cluster.up(i)


def _anomalies(server: RunningServer, names: list[str], problems: list[str]) -> int:
    """The anomalies the checkpoints' statuses count; a status that cannot be read is a problem."""
    found = 0
    with tally.Client(server.grpc_address, timeout=60) as client:
        for name in names:
            try:
                found += client.checkpoint(name).anomalies
            except tally.TallyError as err:
                problems.append(f"the status of {name}: {err}")
    return found


def run_trial(base: Path, url: str, trial: int, rng: random.Random, settle_ms: int) -> dict[str, Any]:
    """One trial: writers on every shard, chaos until they end, then the model checked."""
    names = _checkpoints(trial)
    cluster = _Cluster(base, url, settle_ms)
    acts: list[str] = []
    errors: list[str] = []
    try:
        cluster.start()
        logs = [WriterLog(i, cluster.addresses()) for i in range(SHARDS)]
        plans = [plan_of(trial, i, rng) for i in range(SHARDS)]
        threads = [
            threading.Thread(target=run_writer, args=(log, plan, name, PAUSE_S), name=f"shards-w{log.index}")
            for log, plan, name in zip(logs, plans, names, strict=True)
        ]
        for t in threads:
            t.start()
        writers_done = threading.Event()
        chaos = threading.Thread(target=_chaos, args=(cluster, rng, writers_done, acts, errors), name="chaos")
        chaos.start()
        for t in threads:
            t.join(CLIENT_TIMEOUT * 10)
        writers_done.set()
        chaos.join()
        if errors:
            raise RuntimeError(errors[0].splitlines()[0])
        reader = cluster.live()[0]  # every coordinator is up again once the chaos loop returns
        completed: dict[str, set[str]] = {}
        with tally.Client(cluster.addresses(), timeout=60) as client:
            for plan, name in zip(plans, names, strict=True):
                ids = [sid for sid, _ in plan]
                answer = client.are_completed(name, ids)
                completed[name] = {s for s, done in zip(ids, answer, strict=True) if done}
        anomalies = _anomalies(reader, names, errors)
    finally:
        cluster.close()
    logged = [path.read_text(errors="replace") for path in base.glob("c*/tally-serve.log")]
    lost = sum(len(log.acknowledged - completed[name]) for log, name in zip(logs, names, strict=True))
    false = sum(len(completed[name] - log.fully_queued) for log, name in zip(logs, names, strict=True))
    return {
        "lost": lost,
        "false": false,
        "writers": len(logs),
        "recovered": sum(1 for log in logs if log.finished),
        "ended_by": [log.ended_by or "hung" for log in logs],
        "acknowledged": sum(len(log.acknowledged) for log in logs),
        "anomalies": anomalies,
        "problems": errors,
        "per_writer": [
            (name, log.rounds, len(log.acknowledged), len(completed[name]))
            for log, name in zip(logs, names, strict=True)
        ],
        "acts": acts,
        "restarts": sum(log.count("restarting its service") for log in logged),
        "adoptions": sum(log.count("adopted shard(s)") for log in logged),
    }


def run(trials: int, seed: int) -> Row:
    """``trials`` chaos trials on a sharded store; odd trials settle at once, even ones at 250 ms."""
    row = Row("shards", trials=trials)
    rng = random.Random(seed)
    writers = recovered = acknowledged = anomalies = restarts = adoptions = 0
    acts: list[str] = []
    for trial in range(trials):
        with scratch("shards") as base, _database() as url:
            if url is None:
                row.skipped = f"no PostgreSQL at {PG_ADMIN}"
                return row
            result = run_trial(base, url, trial, rng, settle_ms=0 if trial % 2 else 250)
            if result["problems"] or result["recovered"] < result["writers"] or result["anomalies"]:
                kept = Path(tempfile.mkdtemp(prefix=f"tally-fault-shards-{trial}-logs-"))
                for log in base.glob("c*/tally-serve.log"):
                    shutil.copy(log, kept / f"{log.parent.name}.log")
                row.notes.append(f"trial {trial}: the coordinators' logs are kept in {kept}")
        row.lost += result["lost"]
        row.false += result["false"]
        writers += result["writers"]
        recovered += result["recovered"]
        acknowledged += result["acknowledged"]
        anomalies += result["anomalies"]
        restarts += result["restarts"]
        adoptions += result["adoptions"]
        acts += result["acts"]
        if result["recovered"] < result["writers"]:
            row.failed.append(f"trial {trial}: writers ended by {result['ended_by']} after {result['acts']}")
        row.failed += [f"trial {trial}: {p}" for p in result["problems"]]
        if result["anomalies"]:
            row.failed.append(f"trial {trial}: {result['anomalies']} anomalies after {result['acts']}")
    row.recovered = f"{recovered}/{writers} ({100 * recovered / max(writers, 1):.0f}%)"
    kinds = {k: sum(1 for a in acts if a.startswith(k)) for k in ("kill", "term", "pause")}
    row.notes.insert(
        0,
        f"{acknowledged:,} acked; {kinds['kill']} kill -9, {kinds['term']} SIGTERM, {kinds['pause']} "
        f"SIGSTOP past the lease; {adoptions} adoptions in place, {restarts} service restarts",
    )
    row.figures.update(
        writers=writers,
        recovered=recovered,
        acknowledged=acknowledged,
        anomalies=anomalies,
        acts=acts,
        seed=seed,
    )
    return row

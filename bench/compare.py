"""Tally side by side with the actor it replaces: every figure of issue #10 in one table.

    .venv/bin/python bench/compare.py [--quick | --tiny] [--only FIGURE ...] [--tally-only]

Tally is ``tally serve`` from this worktree with the SDK; the anchor is NeMo Curator 1.4.0's real
``ResumabilityActor``, through Ray (one actor, and four) and its class called in-process, run by
``bench/anchor_worker.py`` under ``.venv-nemo`` (``tests/nemo/setup_env.sh`` builds it). Both get
the same deltas (``bench/_workload.py``). Every figure runs Tally, anchor, Tally, anchor, Tally,
anchor; the table shows the median of the three runs with the range in brackets, Tally ÷ anchor,
the goal of issue #10, and the machine's 1-minute load average over the runs next to its CPU count.

Modes: the default (full) run takes about 10 minutes on 2 cores (15 on a busy machine), plus 2½
for the rerun figure; ``--quick`` (smaller runs, no 10 M-id checkpoint) stays under 5 minutes
(plus 45 s for the rerun); ``--tiny`` is one round of
toy sizes, Tally and anchor side by side, for the smoke test (``tests/bench/test_compare_smoke.py``):
its figures mean nothing.

Figures (``--only``): durable, deltas, latency, load, heartbeats, rerun. The small calls'
figures (latency) are also printed against their floor on this machine, measured in the same round:
a bare grpcio echo, and the echo plus one ``fdatasync`` (``bench/_floor.py``).

The durable and heartbeats figures also run ``tally serve --store`` on PostgreSQL (issue #11) when a
server answers at ``--pg-url`` (default: ``postgresql://postgres@127.0.0.1:5432/postgres``): in a
scratch database created for the run and dropped after it. ``--no-pg`` leaves it out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import _floor
import _tally_side as tside
import _workload as wl

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FIGURES = ("durable", "deltas", "latency", "load", "heartbeats", "rerun")
WRITERS = 4
# are_completed across the PostgreSQL store's replicas: reader processes, ids per call.
REPLICA_READERS = 4
REPLICA_BATCH = 1_000
STAMP = ".installed-nemo-curator-1.4.0"  # what tests/nemo/setup_env.sh leaves in a finished venv
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"  # where the PostgreSQL store's runs go by default

# ------------------------------------------------------------------------------------------------
# ISSUE #9 (journal): the journal-on ÷ journal-off ratio of durable completions/s belongs here.
# Once `tally serve` can switch its journal, set JOURNAL_SWITCH to the extra `tally serve` arguments
# for (on, off): every round then repeats the durable gRPC settle-0 run with each, and the table
# row "durable completions/s, journal on ÷ off" shows the ratio instead of "not measured yet".
JOURNAL_SWITCH: tuple[list[str], list[str]] | None = (["--journal"], ["--no-journal"])
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    rounds: int
    sources: int  # per writer, for durable completions/s and deltas/s (4 deltas each)
    latency_samples: int
    latency_warmup: int
    load_counts: tuple[int, ...]  # completed ids of the pre-built checkpoints
    load_files: int
    queries: int  # ids asked per are_completed ids/s run
    hb_writers: int
    hb_window_s: float
    read_s: float  # how long each are_completed run across replicas lasts


SIZES = {
    "full": Sizes(3, 25_000, 2000, 100, (1_000_000, 10_000_000), 100, 1_000_000, 1000, 30.0, 5.0),
    "quick": Sizes(3, 5_000, 400, 50, (1_000_000,), 100, 200_000, 1000, 10.0, 3.0),
    "tiny": Sizes(1, 50, 20, 5, (10_000,), 100, 20_000, 10, 1.0, 0.5),
}

_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ the anchor


def _private_env(temp_dir: Path) -> dict[str, str]:
    """The anchor's environment, free of the user's Ray settings (as tests/nemo/test_nemo_curator_real.py).

    Ray reads ``RAY_*`` variables and ``~/.ray`` (an ``auth_token`` there turns authentication on),
    so nothing ``RAY_*`` is inherited, HOME and the temp dir are private, authentication is off.
    The marker variable lets the cleanup find every process of this Ray instance.
    """
    home = temp_dir / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "VIRTUAL_ENV"}
    env.update(
        HOME=str(home),
        TMPDIR=str(temp_dir),
        RAY_TMPDIR=str(temp_dir),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=str(BENCH),
        PYTHONUNBUFFERED="1",
        TALLY_BENCH_RAY=str(temp_dir),
    )
    return env


def _pids_with_env(marker: str) -> list[int]:
    needle = marker.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def nemo_venv_problem(venv: Path) -> str | None:
    if not (venv / "bin" / "python").exists() or not (venv / STAMP).exists():
        return (
            f"{venv} is not a finished NeMo Curator venv: run tests/nemo/setup_env.sh (or pass --tally-only)"
        )
    return None


class AnchorProcess:
    """``anchor_worker.py`` under ``.venv-nemo``, in a session of its own, spoken to in JSON lines."""

    def __init__(self, venv: Path, log_path: Path) -> None:
        # Ray's unix sockets live under its temp dir and must stay under ~107 bytes: keep it short.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="tbray-", dir="/tmp"))
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(BENCH / "anchor_worker.py"), str(self.temp_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=_private_env(self.temp_dir),
            cwd=BENCH,
            start_new_session=True,
            text=True,
        )
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name="anchor-answers", daemon=True).start()
        self.info: dict[str, Any] = {}
        self._busy = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)

    def _answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer: dict[str, Any] = json.loads(self._answers.get(timeout=1.0))
                break
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-4000:]
                    raise RuntimeError(
                        f"the anchor stopped answering (exit {self.proc.poll()}):\n{tail}"
                    ) from None
        if "error" in answer:
            raise RuntimeError(f"the anchor failed:\n{answer['error']}")
        return answer

    def ready(self) -> dict[str, Any]:
        if not self.info:
            self.info = self._answer(600)
        return self.info

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        self.ready()
        assert self.proc.stdin is not None
        self._busy = True
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(3600)
        self._busy = False
        return answer

    def stop(self) -> None:
        """``ray.shutdown()`` through the worker, then anything of this Ray instance still alive is killed."""
        try:
            # Busy (the benchmark was interrupted mid-call): nobody waits for the answer, kill it.
            if self.proc.poll() is None and self.proc.stdin is not None and not self._busy:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        for pid in _pids_with_env(f"TALLY_BENCH_RAY={self.temp_dir}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ the PostgreSQL store


class ScratchDatabase:
    """A database of the benchmark's own on a PostgreSQL server, for ``tally serve --store``; see drop()."""

    def __init__(self, admin_url: str) -> None:
        import sqlalchemy as sa

        from tally_server.store.postgres import display, store_url

        admin = store_url(admin_url)
        self._engine = sa.create_engine(
            admin, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        self.name = f"tally_bench_{uuid.uuid4().hex[:10]}"
        try:
            with self._engine.connect() as conn:
                self.version = str(conn.execute(sa.text("SHOW server_version")).scalar())
                conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        except BaseException:
            self._engine.dispose()
            raise
        url = admin.set(database=self.name)
        self.url = url.render_as_string(hide_password=False)
        self.display = display(url)

    def drop(self) -> None:
        import sqlalchemy as sa

        try:
            with self._engine.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        finally:
            self._engine.dispose()


def scratch_database(admin_url: str | None, required: bool) -> ScratchDatabase | None:
    """A scratch database at ``admin_url``; None (logged) if it does not answer and is not ``required``."""
    import sqlalchemy as sa

    try:
        return ScratchDatabase(admin_url or PG_URL)
    except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        if required:
            raise SystemExit(f"compare.py: no scratch database at {admin_url}: {exc.orig}") from None
        log(f"no PostgreSQL at {PG_URL} ({str(exc.orig).strip().splitlines()[0]}): PostgreSQL store not run")
        return None


# ------------------------------------------------------------------------------------- the runs


@dataclass
class Results:
    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    loads: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, key: str, value: float) -> None:
        with self.lock:
            self.values[key].append(value)
            self.loads[key].append(os.getloadavg()[0])


@dataclass
class LoadData:
    tally: Path  # a data dir: checkpoints/bench/ids (+ bench/probe)
    anchor: Path  # a checkpoint dir holding .nemo_curator_metadata (hard links of the same files)
    anchor_empty: Path


class Bench:
    def __init__(
        self,
        sizes: Sizes,
        figures: set[str],
        work: Path,
        anchor: AnchorProcess | None,
        pg: ScratchDatabase | None = None,
    ) -> None:
        self.sizes = sizes
        self.figures = figures
        self.pg = pg  # the PostgreSQL store's durable runs go to this database
        self.work = work
        self.anchor = anchor
        self.results = Results()
        self.pool: tside.WriterPool | None = None
        self.data: dict[int, LoadData] = {}
        self.ray_idle: list[float] = []  # the Ray instance's CPU (fraction of a core) during Tally's runs

    # ---------------------------------------------------------------- preparation (not measured)

    def prepare(self) -> None:
        if self.figures & {"durable", "deltas", "rerun"}:
            self.pool = tside.WriterPool(WRITERS)
        if "load" in self.figures:
            for count in self.sizes.load_counts:
                self.data[count] = self._build(count)

    def _build(self, count: int) -> LoadData:
        import tally
        from tally_server.testing import running_server

        log(f"building a checkpoint of {count:,} completed ids in {self.sizes.load_files} files")
        base = self.work / f"ids-{count}"
        meta = ".nemo_curator_metadata"
        files = tside.build_checkpoint(
            base / "tally" / "checkpoints" / tside.LOADED / meta, count, self.sizes.load_files
        )
        tside.build_checkpoint(base / "tally" / "checkpoints" / tside.PROBE / meta, 100, 1)
        anchor = base / "anchor"
        (anchor / meta).mkdir(parents=True)
        for path in files:  # the same files, read by both sides
            os.link(path, anchor / meta / path.name)
        (base / "anchor-empty").mkdir()
        # The first start adopts the folders it finds and counts them; every measured start is a
        # restart of a coordinator that knows the checkpoint, as after an upgrade or a crash.
        with (
            running_server(base / "tally", settle_ms=0) as server,
            tally.Client(server.grpc_address, timeout=900) as client,
        ):
            client.are_completed(tside.LOADED, ["x"])
            client.are_completed(tside.PROBE, ["x"])
        return LoadData(base / "tally", anchor, base / "anchor-empty")

    # ------------------------------------------------------------------------------ Tally's runs

    def tally_round(self, r: int) -> None:
        # Ray stays up between the anchor's runs; what it burns meanwhile is printed in the header.
        anchor_pid = self.anchor.proc.pid if self.anchor is not None else None
        cpu0, t0 = (tside.cpu_seconds(anchor_pid) if anchor_pid else 0.0), time.perf_counter()
        self._tally_round(r)
        if anchor_pid is not None:
            self.ray_idle.append((tside.cpu_seconds(anchor_pid) - cpu0) / (time.perf_counter() - t0))

    def _tally_round(self, r: int) -> None:
        from tally_server.testing import running_server

        put, s, figs = self.results.put, self.sizes, self.figures
        # Runs of one round share a server (each on a checkpoint of its own): alternate who goes first.
        transports = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
        if figs & {"durable", "deltas", "latency", "rerun"}:
            with running_server(settle_ms=0) as server:
                if "durable" in figs:
                    for transport in transports:
                        put(f"T:durable.{transport}.s0", self._durable(server, transport, f"s0-r{r}"))
                if "deltas" in figs:
                    for writers in (1, WRITERS):
                        for transport in transports:
                            run = self.pool_run(
                                server, transport, f"bench/deltas{writers}-{transport}-r{r}", writers, False
                            )
                            put(f"T:deltas{writers}.{transport}", run.deltas / run.seconds)
                            put(f"T:cpu{writers}.{transport}", run.server_cpu_s / run.deltas)
                            log(
                                f"Tally {transport}: {writers} writers, all +1: "
                                f"{run.deltas / run.seconds:,.0f} deltas/s"
                            )
                if "latency" in figs:
                    asked, applied = tside.latency(
                        server.grpc_address, f"bench/latency-r{r}", s.latency_samples, s.latency_warmup
                    )
                    self._put_latency("T", asked, applied)
                    echoed, synced = _floor.floor(s.latency_samples, s.latency_warmup, self.work)
                    self._put_latency("F", echoed, synced)
                if "rerun" in figs:
                    self._rerun(server, f"bench/rerun-r{r}")
            if "durable" in figs:
                with running_server(settle_ms=250) as server:
                    for transport in transports:
                        put(f"T:durable.{transport}.s250", self._durable(server, transport, f"s250-r{r}"))
                if JOURNAL_SWITCH is not None:
                    for state, extra in zip(("on", "off"), JOURNAL_SWITCH, strict=True):
                        with running_server(settle_ms=0, args=extra) as server:
                            put(f"T:journal.{state}", self._durable(server, "grpc", f"journal-{state}-r{r}"))
                if self.pg is not None:  # the same run as gRPC settle 0, on the PostgreSQL store
                    with running_server(settle_ms=0, store=self.pg.url) as server:
                        put("T:durable.pg.s0", self._durable(server, "grpc", f"pg-r{r}"))
                        self._replica_reads(server, f"bench/durable-grpc-pg-r{r}")
        if "load" in figs:
            for count in s.load_counts:
                res = tside.load(self.data[count].tally, count, s.queries)
                self._check_hits(res, s.queries)
                self._put_load("T", count, res, opened=res["first_answer_s"] - res["listening_s"])
                log(
                    f"Tally, {count:,} ids: first answer after {res['first_answer_s']:.1f} s, "
                    f"{res['ids_per_s']:,.0f} ids/s, {res['rss'] / 1e6:,.0f} MB"
                )
                put(f"T:load{count}.status_growth", res["rss_status"] - res["rss_empty"])
                put(f"T:load{count}.stall", res["stall_s"])
        if "heartbeats" in figs:
            res = tside.heartbeats(s.hb_writers, s.hb_window_s)
            put("T:hb.cpu", res["cpu_fraction"])
            put("T:hb.rss", res["rss"])
            log(f"Tally, {s.hb_writers} writers heartbeating: {res['cpu_fraction']:.0%} of a core")
            if self.pg is not None:
                res = tside.heartbeats(s.hb_writers, s.hb_window_s, store=self.pg.url)
                put("T:hb.cpu_pg", res["cpu_fraction"])
                log(
                    f"Tally, {s.hb_writers} writers heartbeating, PostgreSQL store: "
                    f"{res['cpu_fraction']:.0%} of a core"
                )

    def _replica_reads(self, owner: Any, checkpoint: str) -> None:
        """are_completed ids/s from the owner alone, then from the owner and a replica of the store."""
        from tally_server.testing import running_server

        assert self.pg is not None
        ids = [wl.source_id(n) for n in range(min(REPLICA_BATCH, WRITERS * self.sizes.sources))]
        one = tside.replica_reads([owner], checkpoint, ids, REPLICA_READERS, self.sizes.read_s)
        with running_server(self.work / "replica", settle_ms=0, store=self.pg.url) as replica:
            two = tside.replica_reads([owner, replica], checkpoint, ids, REPLICA_READERS, self.sizes.read_s)
        self.results.put("T:reads.one", one.ids_per_s)
        self.results.put("T:reads.two", two.ids_per_s)
        self.results.put("T:reads.owner_cpu", one.cpu_s_per_id[owner.grpc_address])
        self.results.put("T:reads.replica_cpu", two.cpu_s_per_id[replica.grpc_address])
        one, two = one.ids_per_s, two.ids_per_s
        log(f"are_completed: {one:,.0f} ids/s from the owner alone, {two:,.0f} ids/s from owner + replica")

    def pool_run(
        self, server: Any, transport: str, checkpoint: str, writers: int, complete: bool, tag: str = "bench"
    ) -> tside.Throughput:
        assert self.pool is not None
        return self.pool.run(server, transport, checkpoint, writers, self.sizes.sources, complete, tag)

    def _rerun(self, server: Any, checkpoint: str) -> None:
        """The durable run's deltas on ``checkpoint`` (not measured), then again by new writers: timed."""
        import tally

        expected = WRITERS * self.sizes.sources
        first = self.pool_run(server, "grpc", checkpoint, WRITERS, True)
        if first.completed != expected or first.anomalies:
            raise RuntimeError(f"Tally, the run before the rerun: {first}")
        run = self.pool_run(server, "grpc", checkpoint, WRITERS, True, tag="bench-rerun")
        with tally.Client(server.grpc_address) as client:
            status = client.checkpoint(checkpoint)
        put = self.results.put
        put("T:rerun.grpc", run.deltas / run.seconds)
        put("T:rerun.anomalies", run.anomalies)
        put("T:rerun.status_anomalies", status.anomalies)
        put("T:rerun.completed", status.completed_count)
        log(
            f"Tally gRPC, a rerun over {expected:,} completed sources: {run.deltas / run.seconds:,.0f} "
            f"deltas/s, {run.anomalies:,} anomalies (status: {status.anomalies:,}), "
            f"{status.completed_count:,} completed after it"
        )

    def _durable(self, server: Any, transport: str, tag: str) -> float:
        run = self.pool_run(server, transport, f"bench/durable-{transport}-{tag}", WRITERS, True)
        expected = WRITERS * self.sizes.sources
        if run.completed != expected:
            raise RuntimeError(
                f"Tally {transport} {tag}: {run.completed} sources completed, expected {expected}"
            )
        log(f"Tally {transport} {tag}: {run.completed / run.seconds:,.0f} durable completions/s")
        return run.completed / run.seconds

    # ----------------------------------------------------------------------------- anchor's runs

    ARMS = (("ray1", "ray", 1), ("ray4", "ray", WRITERS), ("inproc", "inproc", 1))

    def anchor_round(self, r: int) -> None:
        assert self.anchor is not None
        put, s, figs = self.results.put, self.sizes, self.figures
        if "durable" in figs:
            for label, mode, actors in self.ARMS:
                res = self._anchor_run(f"durable-{label}-r{r}", mode, actors, WRITERS, True)
                if res["completed"] != WRITERS * s.sources:
                    raise RuntimeError(f"anchor {label}: {res['completed']} sources completed")
                put(f"A:durable.{label}", res["completed"] / res["seconds"])
                log(f"anchor {label}: {res['completed'] / res['seconds']:,.0f} durable completions/s")
        if "deltas" in figs:
            for writers in (1, WRITERS):
                for label, mode, actors in self.ARMS:
                    if actors > writers:
                        continue
                    res = self._anchor_run(f"deltas{writers}-{label}-r{r}", mode, actors, writers, False)
                    put(f"A:deltas{writers}.{label}", res["deltas"] / res["seconds"])
                    put(f"A:cpu{writers}.{label}", res["cpu_s"] / res["deltas"])
                    log(
                        f"anchor {label}: {writers} writers, all +1: "
                        f"{res['deltas'] / res['seconds']:,.0f} deltas/s"
                    )
        if "latency" in figs:
            res = self.anchor.call(
                "latency",
                samples=s.latency_samples,
                warmup=s.latency_warmup,
                dir=str(self._fresh(f"latency-r{r}")),
            )
            self._put_latency("A", res["are_completed_ms"], res["apply_flush_ms"])
        if "load" in figs:
            for count in s.load_counts:
                data = self.data[count]
                res = self.anchor.call(
                    "load",
                    dir=str(data.anchor),
                    empty_dir=str(data.anchor_empty),
                    count=count,
                    queries=s.queries,
                )
                self._check_hits(res, s.queries)
                self._put_load("A", count, res, opened=res["open_s"])
                log(
                    f"anchor, {count:,} ids: first answer after {res['first_answer_s']:.1f} s, "
                    f"{res['ids_per_s']:,.0f} ids/s"
                )
        if "heartbeats" in figs:
            put("A:hb.daemons", self.anchor.call("daemons")["rss"])
        if "rerun" in figs:
            for label, mode, actors in self.ARMS:
                res = self._anchor_run(f"rerun-{label}-r{r}", mode, actors, WRITERS, True, cmd="rerun")
                put(f"A:rerun.{label}", res["deltas"] / res["seconds"])
                put(f"A:rerun_anomalies.{label}", res["anomalies"])
                put(f"A:rerun_completed.{label}", res["completed"])
                log(
                    f"anchor {label}, a rerun over {WRITERS * s.sources:,} completed sources: "
                    f"{res['deltas'] / res['seconds']:,.0f} deltas/s, {res['anomalies']:,} anomalies, "
                    f"{res['completed']:,} completed after it"
                )

    def _fresh(self, name: str) -> Path:
        path = self.work / "anchor-runs" / name
        path.mkdir(parents=True)
        return path

    def _anchor_run(
        self, name: str, mode: str, actors: int, writers: int, complete: bool, cmd: str = "throughput"
    ) -> dict[str, Any]:
        """One ``throughput`` run of the anchor on a fresh folder (``rerun``: two, see anchor_worker.py)."""
        assert self.anchor is not None
        path = self._fresh(name)
        args: dict[str, Any] = {"complete": complete} if cmd == "throughput" else {}
        try:
            return self.anchor.call(
                cmd,
                mode=mode,
                actors=actors,
                writers=writers,
                sources=self.sizes.sources,
                dir=str(path),
                **args,
            )
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------------- shared bits

    def _put_latency(self, side: str, asked: list[float], applied: list[float]) -> None:
        for name, samples in (("ac", asked), ("af", applied)):
            for q in (50, 99):
                self.results.put(f"{side}:lat.{name}.p{q}", wl.percentile(samples, q / 100))
        who = {"T": "Tally", "A": "anchor", "F": "floor (bare grpcio echo, + fdatasync)"}[side]
        log(f"{who} latency p50: {wl.percentile(asked, 0.5):.2f} ms / {wl.percentile(applied, 0.5):.2f} ms")

    def _put_load(self, side: str, count: int, res: dict[str, Any], opened: float) -> None:
        put = self.results.put
        put(f"{side}:load{count}.ids_s", res["ids_per_s"])
        put(f"{side}:load{count}.rss", res["rss"])
        put(f"{side}:load{count}.peak", res["peak"])
        put(f"{side}:load{count}.per_id", (res["rss"] - res["rss_empty"]) / count)
        put(f"{side}:load{count}.first", res["first_answer_s"])
        put(f"{side}:load{count}.open", opened)

    @staticmethod
    def _check_hits(res: dict[str, Any], queries: int) -> None:
        if res["hits"] != (queries + 1) // 2:
            raise RuntimeError(
                f"are_completed found {res['hits']} of the {(queries + 1) // 2} completed ids asked"
            )


# ------------------------------------------------------------------------------------- the table


def _scaled(values: list[float], unit: str) -> tuple[Callable[[float], str], str]:
    """A formatter for ``values`` in a scale chosen by their median, and the unit it prints."""
    mid = statistics.median(values)
    if unit == "/s":
        div, suffix = next(((d, u) for d, u in ((1e6, " M/s"), (1e3, " k/s")) if mid >= d), (1.0, " /s"))
        return (lambda v: f"{v / div:,.{2 if div == 1e6 else 1 if div == 1e3 else 0}f}"), suffix
    if unit == "B":
        return (lambda v: f"{v / 1e6:,.0f}"), " MB"
    if unit == "B/id":
        return (lambda v: f"{v:,.1f}"), " B/id"
    if unit == "ms":
        return (lambda v: f"{v:.2f}"), " ms"
    if unit == "s":
        return (lambda v: f"{v:.2f}" if mid < 10 else f"{v:.1f}"), " s"
    if unit == "µs":
        return (lambda v: f"{v * 1e6:.2f}"), " µs"
    if unit == "core":
        return (lambda v: f"{v * 100:.1f}"), " % of a core"
    if unit in ("anomalies", "sources"):  # counts
        return (lambda v: f"{v:,.0f}"), f" {unit}"
    raise ValueError(unit)


def _signed(fmt: Callable[[float], str]) -> Callable[[float], str]:
    """``fmt`` without a minus on what rounds to zero (a memory growth of -0.3 MB prints 0 MB)."""

    def text(v: float) -> str:
        out = fmt(v)
        return out[1:] if out.startswith("-") and not out.strip("-0.,") else out

    return text


def cell(values: list[float] | None, unit: str) -> str:
    if not values:
        return "—"
    fmt, suffix = _scaled(values, unit)
    fmt = _signed(fmt)
    text = fmt(statistics.median(values)) + suffix
    if len(values) > 1:
        text += f" ({fmt(min(values))}–{fmt(max(values))})"
    return text


@dataclass(frozen=True)
class Goal:
    """``on`` is "ratio" (Tally ÷ anchor) or "tally" (Tally's own figure, in the row's unit)."""

    on: str
    op: str  # ">=" or "<="
    bound: float
    text: str

    def met(self, tally: float, ratio: float | None) -> bool | None:
        value = ratio if self.on == "ratio" else tally
        if value is None:
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound


@dataclass(frozen=True)
class Row:
    figure: str
    tally: str  # key
    unit: str
    anchor: str | None = None  # key
    anchor_label: str = ""
    goals: tuple[Goal, ...] = ()
    note: str = ""  # shown instead of the anchor when there is none
    comparable: bool = True  # False: the anchor's figure is context, not the same quantity


def rows(sizes: Sizes, pg: bool = False) -> Iterator[tuple[str, str, list[Row]]]:
    def at_least(x: float) -> Goal:
        return Goal("ratio", ">=", x, f"≥ {x:g}×")

    not_above = Goal("ratio", "<=", 1.0, "≤ 1×")
    work = f"{WRITERS} writers × {sizes.sources:,} sources × 4 deltas, batches of {wl.BATCH:,}"
    durable: list[Row] = []
    for settle in (0, 250):
        for transport, name in (("grpc", "gRPC"), ("http", "HTTP")):
            key = f"T:durable.{transport}.s{settle}"
            figure = f"durable completions/s, {name}, settle {settle} ms"
            durable += [
                Row(
                    figure,
                    key,
                    "/s",
                    "A:durable.ray4",
                    "Ray, 4 actors",
                    (at_least(3),) if transport == "grpc" else (),
                ),
                Row(figure, key, "/s", "A:durable.ray1", "Ray, 1 actor"),
                Row(
                    figure,
                    key,
                    "/s",
                    "A:durable.inproc",
                    "class in-process",
                    (at_least(1.5),) if transport == "grpc" else (),
                ),
            ]
            if transport == "http":
                durable.append(
                    Row(figure, key, "/s", f"T:durable.grpc.s{settle}", "Tally gRPC", (at_least(0.5),))
                )
    if pg:  # issue #11: at least the anchor's
        figure = "durable completions/s, gRPC, settle 0 ms, PostgreSQL store"
        key = "T:durable.pg.s0"
        durable += [
            Row(figure, key, "/s", "A:durable.ray4", "Ray, 4 actors", (at_least(1),)),
            Row(figure, key, "/s", "A:durable.ray1", "Ray, 1 actor", (at_least(1),)),
            Row(figure, key, "/s", "A:durable.inproc", "class in-process"),
            Row(figure, key, "/s", "T:durable.grpc.s0", "Tally gRPC, LMDB store"),
            Row(
                f"are_completed ids/s, {REPLICA_READERS} readers × {REPLICA_BATCH:,} ids, owner + 1 replica",
                "T:reads.two",
                "/s",
                "T:reads.one",
                "Tally, the owner alone",
                (at_least(1.6),),
            ),
            Row(
                "server CPU per id asked, a replica (PostgreSQL's own not counted)",
                "T:reads.replica_cpu",
                "µs",
                "T:reads.owner_cpu",
                "the owner, from memory",
            ),
        ]
    durable.append(
        Row(
            "durable completions/s, journal on ÷ off",
            "T:journal.on",
            "/s",
            "T:journal.off",
            "journal off",
            note="not measured yet (issue #9): see JOURNAL_SWITCH in bench/compare.py",
        )
    )
    yield (
        "durable",
        f"Durable completions ({work}, fire-and-forget, the time runs until every writer's last flush)",
        durable,
    )

    deltas: list[Row] = []
    for writers in (1, WRITERS):
        for transport, name in (("grpc", "gRPC"), ("http", "HTTP")):
            key = f"T:deltas{writers}.{transport}"
            figure = f"deltas/s, all +1, {writers} writer{'s' if writers > 1 else ''}, {name}"
            goal = (at_least(1.2),) if transport == "grpc" else ()
            deltas.append(Row(figure, key, "/s", f"A:deltas{writers}.ray1", "Ray, 1 actor", goal))
            if writers > 1:
                deltas.append(Row(figure, key, "/s", f"A:deltas{writers}.ray4", "Ray, 4 actors", goal))
            deltas.append(Row(figure, key, "/s", f"A:deltas{writers}.inproc", "class in-process"))
            if transport == "http":
                deltas.append(
                    Row(figure, key, "/s", f"T:deltas{writers}.grpc", "Tally gRPC", (at_least(0.5),))
                )
    for label, name in (
        ("ray1", "Ray, 1 actor (its process only)"),
        ("ray4", "Ray, 4 actors (their processes)"),
        ("inproc", "class in-process"),
    ):
        deltas.append(
            Row(
                f"server CPU per delta, {WRITERS} writers, gRPC",
                f"T:cpu{WRITERS}.grpc",
                "µs",
                f"A:cpu{WRITERS}.{label}",
                name,
                (not_above,) if label != "inproc" else (),
            )
        )
    yield "deltas", f"Deltas, all +1 (nothing completes): {sizes.sources * 4:,} deltas per writer", deltas

    latency = []
    floors = {
        "ac": "floor: a bare grpcio echo, no Tally",
        "af": "floor: a bare grpcio echo + one fdatasync",
    }
    for key, name in (("ac", "are_completed([id])"), ("af", "apply_deltas([d]) + flush()")):
        for q, bound in ((50, 0.6), (99, 2.0)):
            latency += [
                Row(
                    f"{name} p{q}, gRPC",
                    f"T:lat.{key}.p{q}",
                    "ms",
                    f"A:lat.{key}.p{q}",
                    "Ray actor",
                    (Goal("tally", "<=", bound, f"≤ {bound:g} ms"), not_above),
                ),
                # What no Python gRPC service goes below on this machine (bench/_floor.py).
                Row(f"{name} p{q}, gRPC", f"T:lat.{key}.p{q}", "ms", f"F:lat.{key}.p{q}", floors[key]),
            ]
    yield (
        "latency",
        f"One small call, one at a time ({sizes.latency_samples:,} samples per run; "
        "Ray: the same call + ray.get)",
        latency,
    )

    for count in sizes.load_counts:
        n = f"{count / 1e6:g} M" if count >= 1e6 else f"{count:,}"
        big = count >= 10_000_000
        load = [
            Row(
                f"are_completed ids/s, {n} ids",
                f"T:load{count}.ids_s",
                "/s",
                f"A:load{count}.ids_s",
                "Ray actor",
                (Goal("tally", ">=", 500_000, "≥ 500 k/s"),),
            ),
            Row(
                f"resident memory per completed id, {n} ids",
                f"T:load{count}.per_id",
                "B/id",
                f"A:load{count}.per_id",
                "Ray actor",
                (Goal("tally", "<=", 16, "≤ 16 B/id"),),
            ),
            Row(
                f"server RSS with {n} ids loaded",
                f"T:load{count}.rss",
                "B",
                f"A:load{count}.rss",
                "Ray actor",
                (Goal("tally", "<=", 300e6, "≤ 300 MB"),) if big else (),
            ),
            Row(f"peak RSS, {n} ids", f"T:load{count}.peak", "B", f"A:load{count}.peak", "Ray actor"),
            Row(
                f"first answer after start, {n} ids in {sizes.load_files} files",
                f"T:load{count}.first",
                "s",
                f"A:load{count}.first",
                "actor: create → ready → answer",
            ),
            Row(
                f"opening the checkpoint, {n} ids (Tally: first answer − listening)",
                f"T:load{count}.open",
                "s",
                f"A:load{count}.open",
                "the actor's constructor, no Ray",
                (Goal("tally", "<=", 2.0, "≤ 2 s"),) if big else (),
            ),
            Row(
                f"RSS growth from a status read before any id query, {n} ids",
                f"T:load{count}.status_growth",
                "B",
                note="status never loads id sets",
            ),
            Row(
                f"longest call on another checkpoint while {n} ids load",
                f"T:load{count}.stall",
                "s",
                note="reads never starve others",
            ),
        ]
        yield (
            "load",
            f"A checkpoint of {n} completed ids in {sizes.load_files} NeMo files, served after a restart",
            load,
        )

    on_pg = "server CPU, PostgreSQL store (its owner, which also publishes the status for replicas)"

    def heartbeat_cpu(figure: str, key: str) -> Row:
        return Row(
            figure,
            key,
            "core",
            goals=(Goal("tally", "<=", 0.3, "≤ 30 % of a core"),),
            note="one actor per pipeline",
        )

    yield (
        "heartbeats",
        f"{sizes.hb_writers:,} live writers heartbeating (SDK, one asyncio process; lease 30 s), "
        f"over {sizes.hb_window_s:g} s",
        [
            heartbeat_cpu("server CPU", "T:hb.cpu"),
            *([heartbeat_cpu(on_pg, "T:hb.cpu_pg")] if pg else []),
            Row(
                "server RSS",
                "T:hb.rss",
                "B",
                "A:hb.daemons",
                "Ray's own daemons on the node (no writers)",
                comparable=False,
            ),
        ],
    )

    arms = (("ray4", "Ray, 4 actors"), ("ray1", "Ray, 1 actor"), ("inproc", "class in-process"))
    rerun = [
        Row(
            "deltas/s, a rerun over completed sources (every source an anomaly), gRPC",
            "T:rerun.grpc",
            "/s",
            f"A:rerun.{label}",
            name,
        )
        for label, name in arms
    ]
    rerun += [
        Row(
            "anomalies in the rerun (Tally: its writers' close(); anchor: its warnings)",
            "T:rerun.anomalies",
            "anomalies",
            f"A:rerun_anomalies.{label}",
            name,
        )
        for label, name in arms
    ]
    rerun.append(
        Row(
            "anomalies in the checkpoint's status after the rerun",
            "T:rerun.status_anomalies",
            "anomalies",
            note="the anchor keeps no count",
        )
    )
    rerun += [
        Row(
            "sources completed after the rerun (see bench/README.md)",
            "T:rerun.completed",
            "sources",
            f"A:rerun_completed.{label}",
            name,
            comparable=False,
        )
        for label, name in arms
    ]
    yield (
        "rerun",
        f"A rerun over completed sources: {work}, run to completion (not timed), then the same deltas "
        "again by new writers on the same checkpoint (anchor: new actors on the same folder)",
        rerun,
    )


def table(results: Results, sizes: Sizes, figures: set[str], pg: bool = False) -> str:
    cpus = os.cpu_count() or 0
    out = [
        "| figure | Tally | anchor | Tally ÷ anchor | goal | load (1 min) / CPUs |",
        "|---|---|---|---|---|---|",
    ]
    vals = results.values
    for figure, section, section_rows in rows(sizes, pg):
        if figure not in figures:
            continue
        out.append(f"| **{section}** | | | | | |")
        previous = ""
        for row in section_rows:
            tally = vals.get(row.tally)
            anchor = vals.get(row.anchor) if row.anchor else None
            ratio = None
            if (
                row.comparable and tally and anchor and statistics.median(anchor) > 0
            ):  # CPU below a clock tick reads 0
                ratio = statistics.median(tally) / statistics.median(anchor)
            if row.note and not tally:
                tally_cell, anchor_cell = "—", row.note
            else:
                tally_cell = cell(tally, row.unit)
                anchor_cell = (
                    f"{row.anchor_label}: {cell(anchor, row.unit)}" if row.anchor else row.note or "—"
                )
                if row.anchor and row.note and not anchor:
                    anchor_cell = row.note
            verdicts = []
            for goal in row.goals:
                met = goal.met(statistics.median(tally), ratio) if tally else None
                verdicts.append(f"{goal.text} {'' if met is None else 'met' if met else '**MISS**'}".strip())
            loads = results.loads.get(row.tally, []) + (
                results.loads.get(row.anchor, []) if row.anchor else []
            )
            load_cell = f"{min(loads):.1f}–{max(loads):.1f} / {cpus}" if loads else "—"
            ratio_cell = f"{ratio:.2f}×" if ratio is not None else "—"
            if row.figure == previous:  # the same Tally figure against another anchor
                figure_cell, tally_cell = "", ""
            else:
                figure_cell, previous = row.figure, row.figure
            out.append(
                f"| {figure_cell} | {tally_cell} | {anchor_cell} | {ratio_cell} "
                f"| {'; '.join(verdicts)} | {load_cell} |"
            )
    return "\n".join(out)


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def ledger_core() -> str:
    """The counting core the ``tally serve`` processes started here run (they inherit the environment)."""
    from tally_server.domain import idmap

    asked = os.environ.get("TALLY_LEDGER_CORE", "auto").strip().lower()
    return "python" if asked == "python" or idmap.COMPILED is None else "compiled"


def header(
    mode: str,
    sizes: Sizes,
    anchor: dict[str, Any] | None,
    load_at_start: tuple[float, float, float],
    ray_idle: list[float],
    commit: str,
    pg: ScratchDatabase | None = None,
) -> str:
    cpu_model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"bench/compare.py{'' if mode == 'full' else ' --' + mode}: {now}, commit {commit}",
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model}), "
        f"{mem_gb:.1f} GB RAM, "
        f"Python {platform.python_version()}",
        f"load average before the run: {' '.join(f'{x:.2f}' for x in load_at_start)} "
        "(while it runs, the benchmark's own processes add about 2 to 4)",
        f"Tally's counting core: {ledger_core()} (--ledger-core; TALLY_LEDGER_CORE=python for the "
        "pure Python one)",
    ]
    if anchor:
        lines.append(
            f"anchor: NeMo Curator {anchor['nemo_curator']} ResumabilityActor, Ray {anchor['ray']} "
            f"(local instance, started in {anchor['start_s']:.1f} s), Python {anchor['python']}"
        )
        if ray_idle:
            lines.append(
                "the Ray instance stays up during Tally's runs and used "
                f"{statistics.median(ray_idle):.1%} of a core meanwhile (median over the rounds)"
            )
    else:
        lines.append("anchor: not run (--tally-only)")
    if pg is not None:
        lines.append(
            f"PostgreSQL store: PostgreSQL {pg.version}, scratch database {pg.display} (dropped at the end)"
        )
    lines.append(
        f"medians of {sizes.rounds} runs, Tally and anchor interleaved; (min–max) over the runs; "
        "Tally ÷ anchor is the ratio of the medians"
    )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller runs, no 10 M-id checkpoint (≤ 5 min)")
    mode.add_argument("--tiny", action="store_true", help="one round of toy sizes: the smoke test's mode")
    parser.add_argument(
        "--only",
        action="append",
        choices=FIGURES,
        metavar="FIGURE",
        help=f"run only this figure (repeatable): {', '.join(FIGURES)}",
    )
    parser.add_argument(
        "--tally-only", action="store_true", help="leave the anchor out (no .venv-nemo needed)"
    )
    parser.add_argument("--nemo-venv", type=Path, default=REPO / ".venv-nemo", help="NeMo Curator's venv")
    pg_group = parser.add_mutually_exclusive_group()
    pg_group.add_argument(
        "--pg-url",
        help="PostgreSQL server for the PostgreSQL store's durable runs (a scratch database is created "
        f"there and dropped); default {PG_URL} if it answers",
    )
    pg_group.add_argument("--no-pg", action="store_true", help="leave the PostgreSQL store out")
    ns = parser.parse_args(argv)
    mode_name = "quick" if ns.quick else "tiny" if ns.tiny else "full"
    sizes = SIZES[mode_name]
    figures = set(ns.only or FIGURES)
    if not ns.tally_only and (problem := nemo_venv_problem(ns.nemo_venv)):
        parser.error(problem)

    # SIGTERM unwinds like Ctrl-C, so that every server, writer and Ray process is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_at_start = os.getloadavg()
    # The code measured is the code at the start, whatever happens to the worktree meanwhile.
    commit = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " + uncommitted changes"
    work = Path(tempfile.mkdtemp(prefix="tally-compare-"))
    anchor: AnchorProcess | None = None
    bench: Bench | None = None
    pg: ScratchDatabase | None = None
    try:
        if figures & {"durable", "heartbeats"} and not ns.no_pg:
            pg = scratch_database(ns.pg_url, required=ns.pg_url is not None)
            if pg is not None:
                log(f"PostgreSQL store: scratch database {pg.display}")
        if not ns.tally_only:
            anchor = AnchorProcess(ns.nemo_venv, work / "anchor.log")
            log(f"starting the anchor under {ns.nemo_venv}: a local Ray instance in {anchor.temp_dir}")
        bench = Bench(sizes, figures, work, anchor, pg)
        if ns.tiny and anchor is not None:
            # Toy sizes measure nothing: Tally's and the anchor's runs go side by side to stay fast.
            errors: list[BaseException] = []

            def anchor_side() -> None:
                try:
                    bench.anchor_round(0)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            side = threading.Thread(target=anchor_side, name="anchor-round")
            bench.prepare()
            side.start()
            bench.tally_round(0)
            side.join()
            if errors:
                raise errors[0]
        else:
            bench.prepare()
            if anchor is not None:
                log(f"anchor ready: Ray {anchor.ready()['ray']}")
            for r in range(sizes.rounds):
                log(f"round {r + 1}/{sizes.rounds}: Tally")
                bench.tally_round(r)
                if anchor is not None:
                    log(f"round {r + 1}/{sizes.rounds}: anchor")
                    bench.anchor_round(r)
    finally:
        if bench is not None and bench.pool is not None:
            bench.pool.close()
        if anchor is not None:
            anchor.stop()
        if pg is not None:
            pg.drop()
        shutil.rmtree(work, ignore_errors=True)
    info = anchor.info if anchor else None
    print(header(mode_name, sizes, info, load_at_start, bench.ray_idle, commit, pg))
    print()
    print(table(bench.results, sizes, figures, pg is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())

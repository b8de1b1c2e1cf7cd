"""Tally's side of ``bench/compare.py``: SDK writers in processes of their own, and what a running
``tally serve`` costs, read from ``/proc``.

Everything here goes through the public surface only (``tally serve`` via
``tally_server.testing.running_server``, the SDK, NeMo's file format), so the benchmark keeps
measuring whatever server the worktree holds while its insides change.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _workload as wl

if TYPE_CHECKING:
    from tally_server.testing import RunningServer

CLK_TCK = os.sysconf("SC_CLK_TCK")
_CTX = mp.get_context("spawn")
_STEP_TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------------------- /proc


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def _status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants."""
    return sum(_status(p, "VmRSS") for p in process_tree(pid))


def peak_rss_bytes(pid: int) -> int:
    """The largest resident size ``pid`` itself has had (VmHWM)."""
    return _status(pid, "VmHWM")


# -------------------------------------------------------------------------------- writer pool


@dataclass(frozen=True)
class Throughput:
    seconds: float
    deltas: int
    completed: int
    server_cpu_s: float
    anomalies: int = 0  # the writers' close() counts: deltas for sources completed before they opened


def _writer_main(inbox: Any, outbox: Any) -> None:
    import tally

    while (job := inbox.get()) is not None:
        try:
            address, checkpoint, writer, sources, complete, tag = job
            batches = wl.batches(wl.writer_deltas(writer, sources, complete=complete))
            with tally.Client(address) as client:
                w = client.writer(checkpoint, writer_id=f"{tag}-{writer}")
                w.open()
                outbox.put(("ready",))
                inbox.get()  # go
                t0 = time.perf_counter()
                for batch in batches:
                    w.apply_deltas(batch)
                w.flush(timeout=_STEP_TIMEOUT_S)  # the client's default (30 s) is short on a busy machine
                outbox.put(("done", time.perf_counter() - t0))
                result = w.close(timeout=_STEP_TIMEOUT_S)
            counts = result.counts
            outbox.put(("closed", sum(len(b) for b in batches), counts.completed, counts.anomalies))
        except Exception:  # noqa: BLE001 - reported to the parent, which stops
            outbox.put(("error", traceback.format_exc()))


class WriterPool:
    """Writer processes started once (spawning one costs a second of imports) and reused per run."""

    def __init__(self, size: int) -> None:
        self._inboxes = [_CTX.Queue() for _ in range(size)]
        self._outbox = _CTX.Queue()
        self._stash: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        self._procs = [
            _CTX.Process(
                target=_writer_main, args=(inbox, self._outbox), daemon=True, name=f"bench-writer-{i}"
            )
            for i, inbox in enumerate(self._inboxes)
        ]
        for p in self._procs:
            p.start()

    def _next(self, expect: str, server: RunningServer) -> tuple[Any, ...]:
        """The next message of kind ``expect`` from any writer (writers run at their own pace)."""
        deadline = time.monotonic() + _STEP_TIMEOUT_S
        while not self._stash[expect]:
            try:
                msg = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if server.process.poll() is not None:
                    raise RuntimeError(
                        f"tally serve exited ({server.process.returncode}) under the bench writers; "
                        f"its log:\n{server.log()[-4000:]}"
                    ) from None
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"bench writers: waiting for {expect!r}; dead: {dead}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"a bench writer failed:\n{msg[1]}")
            self._stash[msg[0]].append(tuple(msg[1:]))
        return self._stash[expect].pop(0)

    def run(
        self,
        server: RunningServer,
        transport: str,
        checkpoint: str,
        writers: int,
        sources: int,
        complete: bool,
        tag: str = "bench",
    ) -> Throughput:
        """``writers`` writers send their deltas at once; the time runs until the last ``flush()`` returns.

        The writers are ``<tag>-0`` ... ``<tag>-<writers - 1>``: another ``tag`` makes new writers of
        a checkpoint that ones of an earlier run already completed (a rerun).
        """
        address = server.grpc_address if transport == "grpc" else server.http_url
        for i in range(writers):
            self._inboxes[i].put((address, checkpoint, i, sources, complete, tag))
        for _ in range(writers):
            self._next("ready", server)
        cpu0 = cpu_seconds(server.process.pid)
        t0 = time.perf_counter()
        for i in range(writers):
            self._inboxes[i].put("go")
        for _ in range(writers):
            self._next("done", server)
        seconds = time.perf_counter() - t0
        cpu = cpu_seconds(server.process.pid) - cpu0
        closed = [self._next("closed", server) for _ in range(writers)]
        return Throughput(
            seconds, sum(c[0] for c in closed), sum(c[1] for c in closed), cpu, sum(c[2] for c in closed)
        )

    def close(self) -> None:
        """Idle writers exit at once; one still in a run (the benchmark was interrupted) is killed."""
        for inbox in self._inboxes:
            inbox.put(None)
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(10)


# ------------------------------------------------------------------------------------ latency


def latency(address: str, checkpoint: str, samples: int, warmup: int) -> tuple[list[float], list[float]]:
    """Milliseconds of ``are_completed([id])`` and of ``apply_deltas([d]); flush()``, one call at a time."""
    import tally

    with tally.Client(address) as client, client.writer(checkpoint, writer_id="bench-latency") as w:
        known = wl.writer_sources(9, 100)
        w.apply_deltas([(f"0_{s}{suffix}", s, d) for s in known[::2] for suffix, d in (("", 1), ("_0", -1))])
        w.flush()
        asked, applied = [], []
        for i in range(warmup + samples):
            t0 = time.perf_counter()
            client.are_completed(checkpoint, [known[i % len(known)]])
            t1 = time.perf_counter()
            w.apply_deltas([(f"lat-{i}", f"lat-src-{i}", 1)])
            w.flush()
            t2 = time.perf_counter()
            if i >= warmup:
                asked.append((t1 - t0) * 1000)
                applied.append((t2 - t1) * 1000)
    return asked, applied


# ------------------------------------------------------------------------------- loading ids

LOADED = "bench/ids"  # the pre-built checkpoint
PROBE = "bench/probe"  # a small one beside it, asked while the big one loads


def write_nemo_file(path: Path, ids: list[str]) -> None:
    """A completion file as NeMo Curator 1.4.0 writes it (DESIGN §3): LMDB, db ``completed_sources``."""
    import lmdb

    env = lmdb.open(
        str(path), subdir=False, map_size=1 << 30, max_dbs=1, lock=False, sync=False, metasync=False
    )
    try:
        db = env.open_db(b"completed_sources")
        with env.begin(write=True) as txn, txn.cursor(db=db) as cursor:
            cursor.putmulti(((key, b"1") for key in sorted(s.encode() for s in ids)), append=True)
        env.sync(True)
    finally:
        env.close()


def build_checkpoint(folder: Path, count: int, files: int) -> list[Path]:
    """``count`` completed ids spread over ``files`` writer files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(files):
        path = folder / f"node{k:03d}-{1000 + k}.mdb"
        write_nemo_file(path, wl.file_ids(count, files, k))
        paths.append(path)
    return paths


class _Prober(threading.Thread):
    """Asks the small checkpoint, every 20 ms, how one id stands; keeps the longest wait."""

    def __init__(self, address: str) -> None:
        super().__init__(name="bench-prober", daemon=True)
        self._address = address
        self.stop = threading.Event()
        self.longest = 0.0
        self.calls = 0

    def run(self) -> None:
        import tally

        with tally.Client(self._address, timeout=_STEP_TIMEOUT_S) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                client.are_completed(PROBE, [wl.source_id(1)])
                self.longest = max(self.longest, time.perf_counter() - t0)
                self.calls += 1
                self.stop.wait(0.02)  # pacing, so that the prober itself does not load the server


def load(data_dir: Path, count: int, queries: int) -> dict[str, Any]:
    """Start ``tally serve`` on a data dir holding ``count`` completed ids; time its first answer."""
    import tally
    from tally_server.testing import running_server

    t0 = time.perf_counter()
    with running_server(data_dir, settle_ms=0) as server:
        listening = time.perf_counter() - t0
        pid = server.process.pid
        rss_empty = rss_bytes(pid)
        prober = _Prober(server.grpc_address)
        prober.start()
        with tally.Client(server.grpc_address, timeout=_STEP_TIMEOUT_S) as client:  # 10 M ids load slowly
            status = client.checkpoint(LOADED)
            status_s = time.perf_counter() - t0
            rss_status = rss_bytes(pid)
            first = client.are_completed(LOADED, wl.query_ids(count, 2))
            first_answer = time.perf_counter() - t0
            prober.stop.set()
            prober.join(30)
            if first != [True, False] or status.completed_count != count:
                raise RuntimeError(
                    f"{LOADED}: expected {count} completed ids, status says {status.completed_count}"
                )
            rss = rss_bytes(pid)
            asked = wl.query_ids(count, queries)
            t1 = time.perf_counter()
            hits = sum(client.are_completed(LOADED, asked))
            seconds = time.perf_counter() - t1
            peak = peak_rss_bytes(pid)
    return {
        "listening_s": listening,
        "status_s": status_s,
        "first_answer_s": first_answer,
        "rss_empty": rss_empty,
        "rss_status": rss_status,
        "rss": rss,
        "peak": peak,
        "ids_per_s": len(asked) / seconds,
        "hits": hits,
        "stall_s": prober.longest,
    }


# -------------------------------------------------------------------------------- heartbeats


def _heartbeats_main(address: str, checkpoint: str, count: int, inbox: Any, outbox: Any) -> None:
    try:
        asyncio.run(_heartbeats(address, checkpoint, count, inbox, outbox))
    except Exception:  # noqa: BLE001 - reported to the parent, which stops
        outbox.put(("error", traceback.format_exc()))


async def _heartbeats(address: str, checkpoint: str, count: int, inbox: Any, outbox: Any) -> None:
    import tally

    async with tally.AsyncClient(address) as client:
        writers = [client.writer(checkpoint, writer_id=f"hb-{i:04d}") for i in range(count)]
        gate = asyncio.Semaphore(16)

        async def gated(step: Any) -> None:
            async with gate:
                await step

        t0 = time.perf_counter()
        await asyncio.gather(*(gated(w.open()) for w in writers))
        outbox.put(("open", time.perf_counter() - t0))
        await asyncio.get_running_loop().run_in_executor(None, inbox.get)
        unhealthy = sum(not w.health().open for w in writers)
        await asyncio.gather(*(gated(w.close()) for w in writers))
        outbox.put(("closed", unhealthy))


def heartbeats(count: int, window_s: float, store: str | None = None) -> dict[str, Any]:
    """``count`` SDK writers (asyncio, one process) hold their leases on one checkpoint; the server's
    CPU is read over ``window_s`` seconds once they are all open. ``store``: a PostgreSQL URL to
    serve from (its owner also publishes the checkpoint's status, every live writer in it, for
    replicas)."""
    import tally
    from tally_server.testing import running_server

    checkpoint = "bench/heartbeats"
    with running_server(settle_ms=250, store=store) as server:
        pid = server.process.pid
        inbox, outbox = _CTX.Queue(), _CTX.Queue()
        proc = _CTX.Process(
            target=_heartbeats_main, args=(server.grpc_address, checkpoint, count, inbox, outbox), daemon=True
        )
        proc.start()
        try:
            kind, *rest = outbox.get(timeout=_STEP_TIMEOUT_S)
            if kind == "error":
                raise RuntimeError(f"the heartbeating writers failed:\n{rest[0]}")
            opened_s = rest[0]
            time.sleep(1.0)  # let the last opens' registry writes drain before the window
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            time.sleep(window_s)
            cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
            rss = rss_bytes(pid)
            with tally.Client(server.grpc_address) as client:
                live = client.checkpoint(checkpoint).live_writers
            inbox.put("stop")
            kind, *rest = outbox.get(timeout=_STEP_TIMEOUT_S)
            if kind == "error":
                raise RuntimeError(f"the heartbeating writers failed:\n{rest[0]}")
            unhealthy = rest[0]
            proc.join(60)
        finally:
            if proc.is_alive():  # interrupted, or the writers did not finish closing
                proc.kill()
                proc.join(10)
    if live != count or unhealthy:
        raise RuntimeError(f"{count} writers heartbeating: {live} live on the server, {unhealthy} unhealthy")
    return {"cpu_fraction": cpu / wall, "rss": rss, "opened_s": opened_s}


# --------------------------------------------------------------------------- reads across replicas


def _reader_main(address: str, checkpoint: str, ids: list[str], seconds: float, outbox: Any) -> None:
    import tally

    try:
        with tally.Client(address, timeout=60) as client:
            client.are_completed(checkpoint, ids[:10])  # connected before the clock starts
            outbox.put(("ready",))
            asked = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                done = client.are_completed(checkpoint, ids)
                if not all(done):
                    raise RuntimeError(f"{done.count(False)} of {len(ids)} completed ids said not completed")
                asked += len(ids)
            outbox.put(("done", asked, time.perf_counter() - t0, address))
    except Exception:  # noqa: BLE001 - reported to the parent, which stops
        outbox.put(("error", traceback.format_exc()))


@dataclass
class Reads:
    ids_per_s: float
    cpu_s_per_id: dict[str, float]  # per address: the CPU seconds of its server over the ids it answered


def replica_reads(
    servers: list[RunningServer], checkpoint: str, ids: list[str], readers: int, seconds: float
) -> Reads:
    """``are_completed`` ids/s of ``readers`` SDK processes spread over ``servers`` (batches of ``ids``),
    and what each server's process spent per id it answered (not counting PostgreSQL's)."""
    addresses = [s.grpc_address for s in servers]
    outbox = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_reader_main,
            args=(addresses[i % len(addresses)], checkpoint, ids, seconds, outbox),
            daemon=True,
            name=f"bench-reader-{i}",
        )
        for i in range(readers)
    ]
    for p in procs:
        p.start()
    try:
        results = []
        cpu0: dict[str, float] = {}
        while len(results) < 2 * readers:
            if len([m for m in results if m[0] == "ready"]) == readers and not cpu0:
                cpu0 = {s.grpc_address: cpu_seconds(s.process.pid) for s in servers}
            msg = outbox.get(timeout=_STEP_TIMEOUT_S)
            if msg[0] == "error":
                raise RuntimeError(f"a bench reader failed:\n{msg[1]}")
            results.append(msg)
        cpu = {s.grpc_address: cpu_seconds(s.process.pid) - cpu0[s.grpc_address] for s in servers}
        done = [m for m in results if m[0] == "done"]
        asked = {a: sum(m[1] for m in done if m[3] == a) for a in addresses}
        per_id = {a: cpu[a] / asked[a] for a in addresses if asked[a]}  # seconds
        return Reads(sum(m[1] for m in done) / max(m[2] for m in done), per_id)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()

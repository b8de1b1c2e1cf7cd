"""How long the owner's renewals of the PostgreSQL store's lock take under durable load.

    .venv/bin/python bench/lease_renewal.py [--writers W] [--sources-per-writer N] [--pg-url URL]

Runs ``tally serve --store`` on a scratch database (dropped at the end) with ``bench/throughput.py``'s
writers, and prints two sets of figures taken while they write:

- the renewals themselves, as ``tally serve`` times them (its DEBUG line per renewal, the same
  figure as ``tally_store_lease_renew_seconds``): the statement, its WAL flush and the lock
  thread's wait for the GIL;
- a probe on a session of its own, outside ``tally serve``: every 100 ms the renewal's row lock
  (an ``UPDATE`` of ``renewed_at`` alone, to the value it has) without waiting for the WAL, so what
  it waits beyond a round trip is the row lock, behind commits in flight if they hold it up.

A renewal that waits a good part of a second eats into the 5 s a replica leaves a silent owner.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from compare import PG_URL, ScratchDatabase
from throughput import run_writer

from tally_server.testing import running_server

_RENEWED = re.compile(r"renewed the lock of store \S+ in ([0-9.]+) ms")
_PROBE = "UPDATE store_epoch SET renewed_at = renewed_at WHERE id = 1"


def summary(name: str, ms: list[float]) -> str:
    if not ms:
        return f"{name}: none"
    ordered = sorted(ms)
    p99 = ordered[max(0, round(len(ordered) * 0.99) - 1)]
    return (
        f"{name}: n={len(ms)} median {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, "
        f"max {ordered[-1]:.2f} ms, "
        f"{sum(m >= 10 for m in ms)} at 10 ms or more, {sum(m >= 50 for m in ms)} at 50 ms or more"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--sources-per-writer", type=int, default=600_000)
    parser.add_argument(
        "--pg-url", default=PG_URL, help="PostgreSQL server (a scratch database is made there)"
    )
    ns = parser.parse_args()

    pg = ScratchDatabase(ns.pg_url)
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            running_server(Path(tmp), settle_ms=0, store=pg.url, env={"TALLY_LOG_LEVEL": "DEBUG"}) as server,
        ):
            ctx = mp.get_context("spawn")
            start = ctx.Barrier(ns.writers + 1)
            out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
            procs = [
                ctx.Process(
                    target=run_writer, args=(server.grpc_address, i, ns.sources_per_writer, start, out)
                )
                for i in range(ns.writers)
            ]
            for proc in procs:
                proc.start()
            halt = threading.Event()
            probed: list[float] = []

            def probe() -> None:
                with psycopg.connect(pg.url.replace("+psycopg", ""), autocommit=True) as conn:
                    conn.execute("SET synchronous_commit TO off")
                    while not halt.wait(0.1):
                        began = time.perf_counter()
                        conn.execute(_PROBE)
                        probed.append((time.perf_counter() - began) * 1000)

            prober = threading.Thread(target=probe, name="probe")
            before = len(_RENEWED.findall(server.log()))
            start.wait()
            prober.start()
            load = [os.getloadavg()[0]]
            began = time.perf_counter()
            results = [out.get() for _ in procs]
            wall = time.perf_counter() - began
            load.append(os.getloadavg()[0])
            halt.set()
            prober.join()
            for proc in procs:
                proc.join()
            renewals = [float(m) for m in _RENEWED.findall(server.log())[before:]]
    finally:
        pg.drop()
    deltas = sum(r[1] for r in results)
    print(
        f"{ns.writers} writers x {ns.sources_per_writer} sources on PostgreSQL {pg.version}: {wall:.1f} s, "
        f"{deltas / wall:,.0f} deltas/s, load {load[0]:.2f} at the start, {load[1]:.2f} at the end"
    )
    print(summary("renewals (tally serve)", renewals))
    print(summary("probe (the row lock alone)", probed))


if __name__ == "__main__":
    main()

"""Durable completions/s on the PostgreSQL store: one owner, against two coordinators sharing shards.

    .venv/bin/python bench/shards.py [--sources-per-writer N] [--writers W] [--rounds R] [--pg-url URL]

Each round, interleaved, on a scratch database each (dropped after): W writers (processes), each on
a checkpoint of its own, 4 deltas per source, batches of 1,000, flushed at the end, in three setups:

- ``one owner``: a store of one shard, one ``tally serve`` (today's default);
- ``2 owners, direct``: a store of 4 shards, two ``tally serve`` holding 2 each, every writer
  connected to the coordinator holding its checkpoint's shard;
- ``2 owners, via one``: the same, every writer connected to the first coordinator (the calls of
  the other's shards forwarded: what a client given one address pays).

Prints each setup's completions/s per round, the median, its ratio to ``one owner`` and the
machine's load (1 min) beside each. On a machine whose cores PostgreSQL, the writers and every
coordinator share, a second owner adds no CPU: the ratio says what the routing costs, not what a
second machine would give.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import sqlalchemy as sa
from throughput import run_writer  # bench/ is on the path when this runs as a script

SHARDS = 4
_SERVING = re.compile(r"tally serving shard\(s\) (.*) of (\d+) of store")


def checkpoints(writers: int) -> list[str]:
    """One checkpoint per writer, spread evenly over the shards."""
    names: list[str] = []
    i = 0
    while len(names) < writers:
        name = f"bench/shards-{i}"
        if zlib.crc32(name.encode()) % SHARDS == len(names) % SHARDS:
            names.append(name)
        i += 1
    return names


def held(log: str) -> set[int]:
    found = _SERVING.findall(log)
    if not found or found[-1][0].startswith("("):
        return set()
    return {int(s) for s in found[-1][0].split(", ")}


@contextmanager
def scratch(admin: sa.Engine) -> Iterator[str]:
    name = f"tally_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def measure(setup: str, url: str, writers: int, sources: int) -> float:
    from tally_server.testing import running_server

    names = checkpoints(writers)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tally-bench-")))
        if setup == "one owner":
            server = stack.enter_context(running_server(work / "a", settle_ms=0, store=url))
            addresses = [server.grpc_address] * writers
        else:
            args = ["--store-shards", str(SHARDS)]
            first = stack.enter_context(running_server(work / "a", settle_ms=0, store=url, args=args))
            second = stack.enter_context(running_server(work / "b", settle_ms=0, store=url, args=args))
            deadline = time.monotonic() + 60
            while not (
                held(first.log())
                and held(second.log())
                and len(held(first.log()) | held(second.log())) == SHARDS
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the shards did not split between the two coordinators")
                time.sleep(0.1)
            mine = held(first.log())
            if setup == "2 owners, direct":
                addresses = [
                    first.grpc_address if zlib.crc32(n.encode()) % SHARDS in mine else second.grpc_address
                    for n in names
                ]
            else:
                addresses = [first.grpc_address] * writers
        ctx = mp.get_context("spawn")
        start = ctx.Barrier(writers + 1)
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        procs = [
            ctx.Process(target=run_writer, args=(addresses[i], i, sources, start, out, names[i]))
            for i in range(writers)
        ]
        for p in procs:
            p.start()
        start.wait()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    completed = sum(c for _, _, c in results)
    assert completed == writers * sources, (completed, writers * sources)
    return completed / max(e for e, _, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--sources-per-writer", type=int, default=25_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    admin = sa.create_engine(args.pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    admin = admin.execution_options(isolation_level="AUTOCOMMIT")
    setups = ["one owner", "2 owners, direct", "2 owners, via one"]
    figures: dict[str, list[tuple[float, float]]] = {s: [] for s in setups}
    for r in range(args.rounds):
        for setup in setups:  # interleaved: A B C A B C ...
            load = os.getloadavg()[0]
            with scratch(admin) as url:
                rate = measure(setup, url, args.writers, args.sources_per_writer)
            figures[setup].append((rate, load))
            print(f"round {r + 1}, {setup}: {rate:,.0f} completions/s (load {load:.2f})", flush=True)
    base = statistics.median(rate for rate, _ in figures["one owner"])
    print(f"\n{args.writers} writers x {args.sources_per_writer:,} sources, {os.cpu_count()} CPUs")
    print(f"| setup | completions/s (median of {args.rounds}) | ÷ one owner | load (1 min) |")
    print("|---|---|---|---|")
    for setup in setups:
        rates = [rate for rate, _ in figures[setup]]
        loads = [load for _, load in figures[setup]]
        median = statistics.median(rates)
        print(
            f"| {setup} | {median:,.0f} ({min(rates):,.0f}–{max(rates):,.0f}) | {median / base:.2f}× "
            f"| {min(loads):.1f}–{max(loads):.1f} |"
        )


if __name__ == "__main__":
    main()

"""Throughput of durable completions through gRPC: 4 concurrent writers, batches of 1,000 deltas.

    .venv/bin/python bench/throughput.py [--sources-per-writer N] [--writers W] [--store URL]

Prints Tally's figures and, from the same run, a baseline: the same deltas through the same counting
rules and the same LMDB store in one process with no network and no service (one synced commit per
batch). The gap between the two is what the service layer costs. ``--store postgresql://...`` runs
the coordinator on the PostgreSQL store instead (give it an empty database; the baseline stays LMDB).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

BATCH = 1000


def deltas_for(writer: int, sources: int) -> list[tuple[str, str, int]]:
    # Each source: read (+1), a fan-out to 2 (+1), two sinks (-1, -1): 4 deltas, one completion.
    out: list[tuple[str, str, int]] = []
    for n in range(sources):
        sid = f"w{writer}-s{n}"
        root = f"0_{sid}"
        out += [(root, sid, 1), (f"{root}_0", sid, 1), (f"{root}_0_0", sid, -1), (f"{root}_0_1", sid, -1)]
    return out


def run_writer(
    address: str,
    writer: int,
    sources: int,
    start: mp.Barrier,  # type: ignore[type-arg]
    out: mp.Queue,  # type: ignore[type-arg]
    checkpoint: str = "bench/throughput",
) -> None:
    import tally

    deltas = deltas_for(writer, sources)
    with tally.Client(address, timeout=120) as client:
        w = client.writer(checkpoint, writer_id=f"bench-{writer}")
        w.open()
        start.wait()
        t0 = time.perf_counter()
        for i in range(0, len(deltas), BATCH):
            w.apply_deltas(deltas[i : i + BATCH])
        w.flush()
        elapsed = time.perf_counter() - t0
        result = w.close()
    out.put((elapsed, len(deltas), result.counts.completed))


def bench_tally(writers: int, sources: int, settle_ms: int, store: str | None) -> tuple[float, int, int]:
    from tally_server.testing import running_server

    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp), settle_ms=settle_ms, store=store) as server,
    ):
        ctx = mp.get_context("spawn")
        start = ctx.Barrier(writers + 1)
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        procs = [
            ctx.Process(target=run_writer, args=(server.grpc_address, i, sources, start, out))
            for i in range(writers)
        ]
        for p in procs:
            p.start()
        start.wait()
        t0 = time.perf_counter()
        results = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for p in procs:
            p.join()
    return wall, sum(r[1] for r in results), sum(r[2] for r in results)


def bench_baseline(writers: int, sources: int) -> tuple[float, int, int]:
    from tally_server.domain.ledger import WriterLedger
    from tally_server.domain.ports import PutCompleted
    from tally_server.store.lmdb_files import LmdbCompletionStore

    per_writer = [deltas_for(writer, sources) for writer in range(writers)]  # made before the clock runs
    with tempfile.TemporaryDirectory() as tmp:
        store = LmdbCompletionStore(Path(tmp))
        total_deltas = completed = 0
        t0 = time.perf_counter()
        for writer, deltas in enumerate(per_writer):
            ledger = WriterLedger(lambda _sid: False, settle_s=0)
            total_deltas += len(deltas)
            for i in range(0, len(deltas), BATCH):
                done = ledger.mark_completing(ledger.apply(deltas[i : i + BATCH], 0.0).complete_now)
                if done:
                    store.commit([PutCompleted("bench/baseline", f"bench-{writer}", done)])
                completed += len(done)
        wall = time.perf_counter() - t0
        store.close()
    return wall, total_deltas, completed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--sources-per-writer", type=int, default=25_000)
    parser.add_argument("--settle-ms", type=int, default=0, help="server settle window (0 = NeMo's rules)")
    parser.add_argument(
        "--store", default=None, help="PostgreSQL URL: the coordinator's store (an empty database)"
    )
    ns = parser.parse_args()

    name = "tally serve, gRPC" + (", PostgreSQL store" if ns.store else "")
    rows = [
        (name, *bench_tally(ns.writers, ns.sources_per_writer, ns.settle_ms, ns.store)),
        ("baseline: in-process rules + LMDB", *bench_baseline(ns.writers, ns.sources_per_writer)),
    ]
    print(
        f"{ns.writers} writers x {ns.sources_per_writer} sources, "
        f"batches of {BATCH} deltas, settle {ns.settle_ms} ms"
    )
    print(f"{'':36} {'seconds':>8} {'deltas/s':>12} {'completions/s':>14} {'completed':>10}")
    for name, wall, deltas, completed in rows:
        print(f"{name:36} {wall:8.2f} {deltas / wall:12,.0f} {completed / wall:14,.0f} {completed:10,}")
    ratio = rows[1][1] / rows[0][1]
    print(f"tally reaches {ratio:.0%} of the in-process baseline's throughput")


if __name__ == "__main__":
    main()

"""The coordinator's memory per task id a live writer remembers, on each counting core.

    .venv/bin/python bench/remembered.py [--sources N] [--no-journal]

A live writer keeps every task id it applied (a task fired again is skipped: NeMo Curator's rules,
whose actor keeps them in a dict too), until it closes: the part of ``tally serve``'s memory that
grows with a long-lived writer's work (``tally_remembered_tasks``). One writer sends N sources × 4
tasks (``bench/throughput.py``'s deltas, every source completing) in batches of 1,000 to a fresh
``tally serve`` (settle 0) per core, interleaved compiled, python, compiled, python; printed: the
growth of the server's anonymous resident memory (``RssAnon``) between the first flushed batches and
the last, per task id, with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import anonymous_mb  # noqa: E402
from throughput import BATCH, deltas_for  # noqa: E402

import tally  # noqa: E402
from tally_server.testing import running_server  # noqa: E402

WARM = 4 * BATCH  # the batches sent before the first reading: connection, first allocations


def grow(core: str, sources: int, journal: bool) -> tuple[float, int]:
    """MB the server grew by while one writer sent ``sources`` × 4 tasks, and how many tasks."""
    deltas = deltas_for(0, sources)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    args = ["--ledger-core", core] + ([] if journal else ["--no-journal"])
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp), settle_ms=0, env=env, args=args) as server,
        tally.Client(server.grpc_address, timeout=120) as client,
    ):
        writer = client.writer("bench/remembered", writer_id="long-lived")
        writer.open()
        writer.apply_deltas(deltas[:WARM])
        writer.flush()
        before = anonymous_mb(server.process.pid)
        for i in range(WARM, len(deltas), BATCH):
            writer.apply_deltas(deltas[i : i + BATCH])
        writer.flush()
        after = anonymous_mb(server.process.pid)
        writer.close()
    return after - before, len(deltas) - WARM


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sources", type=int, default=250_000)
    parser.add_argument("--no-journal", action="store_true", help="the servers run without the journal")
    ns = parser.parse_args()
    journal = not ns.no_journal
    print(f"one live writer, {ns.sources:,} sources x 4 tasks, journal {'on' if journal else 'off'}")
    print(f"{'core':10} {'grew MB':>8} {'B per task id':>14} {'load (1 min) / CPUs':>20}")
    for core in ("compiled", "python", "compiled", "python"):
        mb, tasks = grow(core, ns.sources, journal)
        load = f"{os.getloadavg()[0]:.1f} / {os.cpu_count()}"
        print(f"{core:10} {mb:8.0f} {mb * 1e6 / tasks:14.0f} {load:>20}")


if __name__ == "__main__":
    main()

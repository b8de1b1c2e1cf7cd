"""Commit latency of the writers' journal log around its rewrites (issue #10's journal follow-ups).

    .venv/bin/python bench/journal_rewrite.py [--live-mib 4] [--min-mib 8] [--commits 20000] [--dir D]

One writer's worth of small commits (an entry of ~2 KiB each, fdatasync'd, as a durable ack makes)
on top of a live state of ``--live-mib`` (many writers' entries), with the rewrite threshold lowered
to ``--min-mib``: the log is rewritten several times in the run. Prints the commits' latencies
(median, p99, max) and the slowest commits, with how many rewrites happened. Run it against another
checkout's server (``PYTHONPATH=<other>/server/src``) to compare: a log that rewrites inside the
commit that triggers it shows that commit's wait as the max.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from tally_server.domain.journal import Opened, Persisted
from tally_server.domain.ports import JournalEntry, OpenJournal
from tally_server.store import journal_log
from tally_server.store.journal_log import LogJournal


class _Rewrites(logging.Handler):
    """When each rewrite started (a line this checkout logs at DEBUG; none before) and ended."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[float] = []
        self.ended: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "rewriting the writers' journal" in record.getMessage():
            self.started.append(time.perf_counter())
        elif "rewrote" in record.getMessage():
            self.ended.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--live-mib", type=int, default=4)
    parser.add_argument("--min-mib", type=int, default=8)
    parser.add_argument("--commits", type=int, default=20000)
    parser.add_argument("--dir", type=Path, default=None, help="where to put the log (a real disk)")
    args = parser.parse_args()
    journal_log.COMPACT_MIN_BYTES = args.min_mib << 20
    rewrites = _Rewrites()
    logging.getLogger(journal_log.__name__).addHandler(rewrites)
    logging.getLogger(journal_log.__name__).setLevel(logging.DEBUG)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        journal = LogJournal(Path(folder))
        journal_log.COMPACT_MIN_BYTES = 1 << 40  # build the live state without a rewrite
        blob = "x" * 2000
        per_writer = 64
        writers = max(1, (args.live_mib << 20) // (per_writer * len(blob)))
        for w in range(writers):
            handle = f"live{w}"
            opened = Opened(handle, "cp/x", f"writer-{w}", "host", 7, {}, {}, 1.5, "tok")
            journal.commit([OpenJournal(opened)])
            journal.commit([JournalEntry(handle, i, Persisted([blob])) for i in range(1, per_writer + 1)])
        journal_log.COMPACT_MIN_BYTES = args.min_mib << 20
        opened = Opened("hot", "cp/x", "writer-hot", "host", 7, {}, {}, 1.5, "tok")
        journal.commit([OpenJournal(opened)])
        commits: list[tuple[float, float]] = []  # (start, end)
        for i in range(args.commits):  # the same few entries over and over: dead records
            started = time.perf_counter()
            journal.commit([JournalEntry("hot", 1 + i % 4, Persisted([blob]))])
            commits.append((started, time.perf_counter()))
        if hasattr(journal, "wait_rewritten"):
            journal.wait_rewritten()
        journal.close()
    ms = sorted((end - start) * 1000 for start, end in commits)
    # The commit that triggered each rewrite: the one it started in (in the background), or, where
    # nothing says it started, the one it ended in (inside the commit).
    marks = rewrites.started or rewrites.ended
    triggering = [next((e - s) * 1000 for s, e in commits if s <= t <= e) for t in marks]
    windows = list(zip(rewrites.started, rewrites.ended, strict=False)) if rewrites.started else []
    during = [(e - s) * 1000 for s, e in commits if any(a <= e and s <= b for a, b in windows)]
    print(
        f"live state {args.live_mib} MiB, rewrite past {args.min_mib} MiB, {args.commits} commits, "
        f"{len(rewrites.ended)} rewrites, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"commit latency ms: median {statistics.median(ms):.2f}  p99 {ms[int(len(ms) * 0.99)]:.2f}  "
        f"max {ms[-1]:.1f}  slowest five {', '.join(f'{x:.1f}' for x in ms[-5:])}"
    )
    print(f"the commits that triggered a rewrite, ms: {', '.join(f'{x:.1f}' for x in triggering)}")
    if windows:
        print(
            f"rewrites took ms: {', '.join(f'{(b - a) * 1000:.0f}' for a, b in windows)}; the {len(during)} "
            f"commits made meanwhile: median {statistics.median(during):.2f}, max {max(during):.1f}"
        )


if __name__ == "__main__":
    main()

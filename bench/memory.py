"""The coordinator's resident memory as checkpoints are made and filled through it.

    .venv/bin/python bench/memory.py [--checkpoints N] [--rounds R] [--sources-per-writer S]
                                     [--mmap-threshold BYTES] [--wait-s SECONDS]

Starts ``tally serve`` (LMDB store, settle 0) and prints its anonymous resident memory (``RssAnon``:
the process's own, not the page cache of the files it maps) after each stage:

1. ``--checkpoints`` new checkpoints with one writer and one completion each;
2. ``--rounds`` rounds of 4 writers (processes) × S sources, 4 deltas each, on a new checkpoint per
   round, durable (``bench/throughput.py``'s writer), with the round's completions/s: right after
   the writers closed, and once the server's estimate of the round's set is down to 16 B/id (its
   ids merged into the compact index; waiting at most ``--wait-s``).

``--mmap-threshold`` starts the server with ``MALLOC_MMAP_THRESHOLD_`` set to it (the server then
leaves glibc's threshold alone, see ``tally_server.malloc``): ``33554432`` is about what glibc's
own dynamic threshold rises to, that is the server as it was before it fixed the threshold.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import tempfile
import time
from pathlib import Path

import httpx
from throughput import run_writer  # bench/ is on the path when this runs as a script

import tally
from tally_server.testing import running_server


def anonymous_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def loaded_bytes(http: httpx.Client, checkpoint: str) -> float:
    text = http.get("/metrics").text
    series = f'tally_checkpoint_loaded_bytes{{checkpoint="{checkpoint}"}} '
    match = re.search(rf"^{re.escape(series)}(\S+)$", text, re.M)
    return float(match[1]) if match else 0.0


def settled(http: httpx.Client, checkpoint: str, ids: int, wait_s: float) -> float:
    """Wait (at most ``wait_s``) until the checkpoint's estimate is down to 16 B/id; the time waited."""
    t0 = time.perf_counter()
    while loaded_bytes(http, checkpoint) > 16 * ids and time.perf_counter() - t0 < wait_s:
        time.sleep(0.05)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoints", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--sources-per-writer", type=int, default=25_000)
    parser.add_argument("--mmap-threshold", type=int, default=None)
    parser.add_argument("--wait-s", type=float, default=10.0)
    args = parser.parse_args()
    env = {} if args.mmap_threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
    ctx = mp.get_context("spawn")
    with (
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp) / "data", settle_ms=0, env=env) as server,
    ):
        pid = server.process.pid
        print(f"mmap threshold: {args.mmap_threshold or 'fixed by the server (1 MiB)'}")
        print(f"started: {anonymous_mb(pid):.0f} MB anonymous, load {os.getloadavg()[0]:.2f}")
        http = stack.enter_context(httpx.Client(base_url=server.http_url, timeout=30))
        with tally.Client(server.grpc_address) as client:
            for i in range(args.checkpoints):
                with client.writer(f"mem/one-{i}", writer_id="w") as w:
                    w.apply_deltas([(f"0_s{i}", f"s{i}", 1), (f"0_s{i}_0", f"s{i}", -1)])
        print(f"after {args.checkpoints} checkpoints of one completion: {anonymous_mb(pid):.0f} MB")
        for r in range(args.rounds):
            start, out = ctx.Barrier(5), ctx.Queue()
            writers = [
                ctx.Process(
                    target=run_writer,
                    args=(server.grpc_address, w, args.sources_per_writer, start, out, f"mem/round-{r}"),
                )
                for w in range(4)
            ]
            for p in writers:
                p.start()
            start.wait()
            results = [out.get() for _ in writers]
            for p in writers:
                p.join()
            elapsed = max(e for e, _, _ in results)
            done = sum(c for _, _, c in results)
            right_after = anonymous_mb(pid)
            waited = settled(http, f"mem/round-{r}", done, args.wait_s)
            print(
                f"after round {r + 1} ({done:,} completions, {done / elapsed:,.0f}/s): "
                f"{right_after:.0f} MB; {anonymous_mb(pid):.0f} MB once merged ({waited:.1f} s), "
                f"load {os.getloadavg()[0]:.2f}"
            )


if __name__ == "__main__":
    main()

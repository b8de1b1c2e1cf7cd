"""The fault campaign: real ``tally serve`` processes, real SDK clients, real files, bad days on purpose.

    .venv/bin/python bench/faults.py [--trials N] [--quick] [--only SCENARIO ...] [--seed S]

Scenarios (docs/faults.md states what Tally promises under each):
  kill9          N trials of kill -9 under load, restart on the same data dir, check a reference model
  read_storm     idle writers (lease 10 s) under status-read storms (50 readers; 500 GET /v1/checkpoints)
  chunked        80 MB (and 200 MB) of small deltas in a chunked HTTP body, no Content-Length
  disk_full      the data dir on an 8 MB tmpfs filled up, then freed (root only; skipped otherwise)
  damaged_files  truncated, garbage, MDB_CORRUPTED and symlinked completion files, served
  bad_requests   a sweep of malformed requests over gRPC and HTTP
  shards         3 coordinators on a PostgreSQL store of 4 shards, writers on every shard, coordinators
                 killed -9, stopped and paused past their leases at random (skipped without PostgreSQL)

Prints one row per scenario. The cells lost, false, expired (healthy writers), 5xx/INTERNAL and
outside (files created or written outside the data dir) must be 0; other expectations that failed
are listed as FAIL lines. Exits 1 if any must-be-zero cell is not 0 or any FAIL line is printed.
Figures depend on the machine's load, hence the load average beside each row.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench._faultlib and tests.nemo_format

from bench._faultlib import bad_requests, chunked, damaged, disk_full, kill9, read_storm, shards  # noqa: E402
from bench._faultlib.common import Row, kill_all, load_average  # noqa: E402

SCENARIOS = ("kill9", "read_storm", "chunked", "disk_full", "damaged_files", "bad_requests", "shards")


def plan(args: argparse.Namespace) -> dict[str, Callable[[], Row]]:
    trials = args.trials if args.trials is not None else (3 if args.quick else 20)
    sizes = [80_000_000] if args.quick else [80_000_000, 200_000_000]
    return {
        "kill9": lambda: kill9.run(trials, args.seed),
        "read_storm": lambda: read_storm.run(10.0 if args.quick else 30.0),
        "chunked": lambda: chunked.run(sizes),
        "disk_full": lambda: disk_full.run(3.0, 10.0) if args.quick else disk_full.run(),
        "damaged_files": damaged.run,
        "bad_requests": bad_requests.run,
        "shards": lambda: shards.run(1 if args.quick else 4, args.seed),
    }


def run_one(name: str, scenario: Callable[[], Row]) -> Row:
    started = time.monotonic()
    try:
        row = scenario()
    except Exception as exc:
        traceback.print_exc()
        row = Row(name)
        row.failed.append(f"the scenario itself failed: {exc!r}")
    row.seconds = time.monotonic() - started
    row.load = load_average()
    return row


HEADER = (
    "scenario",
    "trials",
    "lost",
    "false",
    "expired",
    "5xx/INTERNAL",
    "outside",
    "recovered",
    "load 1/5/15",
    "time",
)


def cells(row: Row) -> tuple[str, ...]:
    if row.skipped is not None:
        return (row.scenario, "-", "-", "-", "-", "-", "-", "-", _load(row), f"{row.seconds:.0f}s")

    def zero(n: int) -> str:
        return f"{n:,}" if n == 0 else f"{n:,} !"

    return (
        row.scenario,
        str(row.trials),
        zero(row.lost),
        zero(row.false),
        zero(row.expired),
        zero(row.errors),
        zero(row.outside),
        row.recovered,
        _load(row),
        f"{row.seconds:.0f}s",
    )


def _load(row: Row) -> str:
    return "/".join(f"{x:.1f}" for x in row.load)


def table(rows: list[Row]) -> str:
    body = [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in [HEADER, *body]) for i in range(len(HEADER))]

    def line(values: tuple[str, ...]) -> str:
        pairs = enumerate(zip(values, widths, strict=True))
        return "  ".join(v.ljust(w) if i in (0, 7) else v.rjust(w) for i, (v, w) in pairs)

    out = [line(HEADER), "  ".join("-" * w for w in widths)]
    for row, values in zip(rows, body, strict=True):
        out.append(line(values))
        if row.skipped is not None:
            out.append(f"    skipped: {row.skipped}")
        out += [f"    {note}" for note in row.notes]
        out += [f"    FAIL: {failure}" for failure in row.failed]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, help="kill -9 trials (default 20, --quick 3)")
    parser.add_argument("--quick", action="store_true", help="fewer trials, shorter storms, no 200 MB body")
    parser.add_argument(
        "--only", action="append", choices=SCENARIOS, help="run only this scenario (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=7, help="random seed of the kill -9 moments and splits")
    args = parser.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        parser.error("--trials must be at least 1")

    # Unreachable coordinators and lost leases are what this campaign causes; the SDK's warnings
    # about them would bury the table.
    logging.getLogger("tally").setLevel(logging.CRITICAL)
    logging.getLogger("tests.nemo_format").setLevel(logging.ERROR)  # skipped files are counted instead

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through every finally: servers killed, tmpfs unmounted

    signal.signal(signal.SIGTERM, interrupted)
    scenarios = plan(args)
    names = [n for n in SCENARIOS if not args.only or n in args.only]
    print(
        f"fault campaign: {', '.join(names)} ({'quick' if args.quick else 'full'}, seed {args.seed})",
        flush=True,
    )
    rows: list[Row] = []
    try:
        for name in names:
            print(f"  {name} ...", end="", flush=True)
            row = run_one(name, scenarios[name])
            rows.append(row)
            verdict = "skipped" if row.skipped is not None else ("ok" if row.ok else "FAILED")
            print(f" {verdict} in {row.seconds:.0f}s", flush=True)
    finally:
        leftover = kill_all()
        if leftover:
            print(f"killed {leftover} server processes left running", file=sys.stderr)
    print()
    print(table(rows))
    failed = [r.scenario for r in rows if not r.ok]
    print()
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("all must-be-zero cells are 0 and every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resumable pipeline on a process pool: workers process files, the parent reports to Tally.

The same pipeline as ``plain_python.py`` (whose functions it reuses), on a
``concurrent.futures.ProcessPoolExecutor``. A run has one writer, in the parent: the parent starts
each source (+1) and ships its task to a worker; the worker records the outcomes of the task's tree
in a ``Report`` and returns it; the parent applies the reports, in submission order.

    python examples/multiprocessing_pool.py --address 127.0.0.1:50051 --checkpoint demo/pool \\
        --input /tmp/in --output /tmp/out --generate 8 --workers 2 [--fail-after 3]
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path

import tally
from tally.integrations.tracker import Report, Task, Tracker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_python import generate, make_parser, plural, process  # noqa: E402


def work(task: Task, input_dir: Path, output_dir: Path) -> Report:
    """Runs in a worker process: the task arrives as plain ids and is adopted by a Report."""
    report = Report()
    process(report.adopt(task), input_dir, output_dir)
    return report


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    args = parser.parse_args()
    if args.generate:
        generate(args.input, args.generate)
    args.output.mkdir(parents=True, exist_ok=True)
    sources = sorted(p.name for p in args.input.glob("*.txt"))

    with tally.Client(args.address) as client, client.writer(args.checkpoint) as writer:
        tracker = Tracker(writer)
        todo = tracker.todo(sources)
        print(f"skipping {plural(len(sources) - len(todo), 'completed source')}", flush=True)
        tasks = [tracker.start(source) for source in todo]
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            reports = pool.map(work, tasks, repeat(args.input), repeat(args.output))
            for count, (task, report) in enumerate(zip(tasks, reports, strict=True)):
                if count == args.fail_after:
                    pool.shutdown(cancel_futures=True)  # let running workers finish, start no more
                    writer.flush()
                    print(f"crashing after {plural(count, 'source')}", flush=True)
                    os._exit(3)  # like a kill: no cleanup, the writer is not closed
                tracker.apply(report)
                print(f"processed {task.source_id}", flush=True)
    print(f"done: {len(todo)} processed", flush=True)


if __name__ == "__main__":
    main()

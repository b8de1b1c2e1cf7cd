"""A SLURM array task's worker: its shard of the input files, tracked by Tally (README.md here).

Every task of the array is a writer of the same checkpoint on one coordinator. Task
``$SLURM_ARRAY_TASK_ID`` of ``$SLURM_ARRAY_TASK_COUNT`` takes every COUNT-th input file; before
working it asks the coordinator which files are completed (by any task, of this array or an earlier
one) and skips them, so rerunning the whole array after a failure only does what is left. It claims
each file just before working on it and skips files another live writer holds, so an array started
while another is still running on the same checkpoint splits the work with it instead of redoing it.

    WORKER_CMD='python deploy/slurm/worker.py --checkpoint curation/run-1 \\
                --input /shared/in --output /shared/out' \\
        sbatch --dependency=after:$COORD_JOB deploy/slurm/array.sbatch

The coordinator address comes from ``$TALLY_ADDRESS`` (array.sbatch sets it) or ``--address``.
SLURM's job ids are added to the writer's labels by the SDK, so ``tally writers CHECKPOINT`` shows
which array task each writer is. Replace ``process`` with your own work; keep one outcome
(``done``/``drop``/``split``/``then``/``failed``) per task.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import tally
from tally.integrations.tracker import Task, Tracker


def process(task: Task, input_dir: Path, output_dir: Path) -> None:
    """An example: each non-empty line of the file becomes one output file; empty lines are filtered."""
    lines = (input_dir / task.source_id).read_text().splitlines()
    stem = Path(task.source_id).stem
    for i, (part, line) in enumerate(zip(task.split(len(lines)), lines, strict=True)):
        if not line.strip():
            part.drop()
            continue
        out = output_dir / f"{stem}-{i}.txt"
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(line.upper() + "\n")
        tmp.replace(out)  # a crash never leaves half an output
        part.done()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="coordinator address (default: $TALLY_ADDRESS)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint name, the same for every task")
    parser.add_argument("--input", type=Path, required=True, help="directory of input .txt files")
    parser.add_argument("--output", type=Path, required=True, help="directory for the outputs")
    parser.add_argument("--fail-after", type=int, help="crash after this many sources (for testing)")
    parser.add_argument("--work-ms", type=int, default=0, help="extra time each source takes (for testing)")
    args = parser.parse_args()
    if not args.input.is_dir():
        parser.error(f"--input {args.input} is not a directory; give the directory of the input .txt files")

    index = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    count = int(os.environ.get("SLURM_ARRAY_TASK_COUNT", "1"))
    # Sorted, so that every task computes the same shards.
    shard = sorted(p.name for p in args.input.glob("*.txt"))[index::count]
    args.output.mkdir(parents=True, exist_ok=True)

    with tally.Client(args.address) as client, client.writer(args.checkpoint) as writer:
        tracker = Tracker(writer)
        todo = tracker.todo(shard)
        print(f"task {index}/{count}: {len(shard)} sources, {len(shard) - len(todo)} completed", flush=True)
        if args.fail_after == 0:
            crash(writer, 0)
        for done, source in enumerate(tracker.claim(todo), start=1):
            time.sleep(args.work_ms / 1000)
            process(tracker.start(source), args.input, args.output)
            print(f"processed {source}", flush=True)
            if done == args.fail_after:  # before claiming the next source
                crash(writer, done)


def crash(writer: tally.Writer, done: int) -> None:
    """Stop like a killed process (no cleanup, the writer is not closed), its work so far durable."""
    writer.flush()
    print(f"crashing after {done} source{'' if done == 1 else 's'}", flush=True)
    os._exit(3)


if __name__ == "__main__":
    main()

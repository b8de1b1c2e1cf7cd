"""Resumable plain-Python pipeline: one loop over input files, tracked by Tally.

Each input file is a source. A file is read (the source task), split into chunks of up to three
lines (fan-out), chunks holding a line ``skip`` are filtered out and the others are upper-cased
(a 1:1 stage) and written to ``OUTPUT/<file>-<chunk>.txt`` (the sink). Run it twice: the second
run skips every file the first one completed.

    python examples/plain_python.py --address 127.0.0.1:50051 --checkpoint demo/plain \\
        --input /tmp/in --output /tmp/out --generate 8 [--fail-after 3]

``--fail-after K`` makes the run crash (exit status 3, writer not closed) after K files.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import tally
from tally.integrations.tracker import Task, Tracker

CHUNK_LINES = 3


def generate(input_dir: Path, count: int) -> None:
    """Write ``count`` small input files (the same every time)."""
    input_dir.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        lines = ["skip" if (i + j) % 4 == 0 else f"file {i} line {j}" for j in range(2 + i % 5)]
        (input_dir / f"part-{i:03d}.txt").write_text("\n".join(lines) + "\n")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def process(task: Task, input_dir: Path, output_dir: Path) -> None:
    """Process one source file; every branch of its tree ends in done() or drop()."""
    lines = (input_dir / task.source_id).read_text().splitlines()
    chunks = [lines[i : i + CHUNK_LINES] for i in range(0, len(lines), CHUNK_LINES)]
    for i, (part, chunk) in enumerate(zip(task.split(len(chunks)), chunks, strict=True)):
        if "skip" in chunk:
            part.drop()  # filtered: nothing to write
            continue
        upper = part.then()  # a 1:1 stage
        stem = Path(task.source_id).stem
        write_atomically(output_dir / f"{stem}-{i}.txt", "\n".join(chunk).upper() + "\n")
        upper.done()  # written: this branch is finished


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 source", "3 sources"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def make_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--address", help="coordinator address (default: $TALLY_ADDRESS)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint name, one per pipeline run")
    parser.add_argument("--input", type=Path, required=True, help="directory of input .txt files")
    parser.add_argument("--output", type=Path, required=True, help="directory for the outputs")
    parser.add_argument("--generate", type=int, default=0, help="first write this many input files")
    parser.add_argument("--fail-after", type=int, help="crash after this many sources (for testing)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.generate:
        generate(args.input, args.generate)
    args.output.mkdir(parents=True, exist_ok=True)
    sources = sorted(p.name for p in args.input.glob("*.txt"))

    with tally.Client(args.address) as client, client.writer(args.checkpoint) as writer:
        tracker = Tracker(writer)
        todo = tracker.todo(sources)
        print(f"skipping {plural(len(sources) - len(todo), 'completed source')}", flush=True)
        for count, source in enumerate(todo):
            if count == args.fail_after:
                writer.flush()  # what was reported so far is durable
                print(f"crashing after {plural(count, 'source')}", flush=True)
                os._exit(3)  # like a kill: no cleanup, the writer is not closed
            process(tracker.start(source), args.input, args.output)
            print(f"processed {source}", flush=True)
    print(f"done: {len(todo)} processed", flush=True)


if __name__ == "__main__":
    main()

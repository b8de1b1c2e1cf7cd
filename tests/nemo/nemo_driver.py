"""Run the test pipeline once, as a user would: ``.venv-nemo/bin/python nemo_driver.py ...``.

JsonlReader(files_per_partition=1) → FanOut (1→3) → DropSome (filter) → JsonlWriter, with
``pipeline.run(checkpoint_path=...)``; with ``--tally-checkpoint`` inside the Tally drop-in, without
it plain NeMo Curator (its own LMDB files under ``--checkpoint-path``). Needs ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from nemo_curator.backends.xenna import XennaExecutor
from nemo_curator.pipeline import Pipeline
from nemo_curator.stages.text.io.reader import JsonlReader
from nemo_curator.stages.text.io.writer import JsonlWriter
from nemo_stages import DropSome, FanOut

from tally.integrations.nemo_curator import tally_for_nemo_curator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--checkpoint-path", required=True)
    parser.add_argument("--seen-dir", required=True)
    parser.add_argument("--gate-dir", default="")
    parser.add_argument("--pass-limit", type=int, default=-1)
    parser.add_argument("--tally-address")
    parser.add_argument("--tally-checkpoint")
    args = parser.parse_args()

    pipeline = Pipeline(name="tally_nemo_test")
    pipeline.add_stage(JsonlReader(file_paths=args.input, files_per_partition=1))
    pipeline.add_stage(FanOut(seen_dir=args.seen_dir, gate_dir=args.gate_dir, pass_limit=args.pass_limit))
    pipeline.add_stage(DropSome())
    pipeline.add_stage(JsonlWriter(path=args.output))

    tally: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if args.tally_checkpoint:
        tally = tally_for_nemo_curator(checkpoint=args.tally_checkpoint, address=args.tally_address)
    start = time.monotonic()
    with tally:
        pipeline.run(XennaExecutor(), checkpoint_path=args.checkpoint_path)
    print(f"pipeline.run took {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()

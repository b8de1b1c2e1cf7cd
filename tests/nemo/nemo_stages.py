"""Custom NeMo Curator stages of the real-client test; Ray workers import them from ``PYTHONPATH``.

``FanOut`` splits each partition (one input file) into ``PARTS`` tasks and records every partition
it sees; ``DropSome`` filters some of those tasks. Under a pass limit, ``FanOut`` lets only the first
``pass_limit`` partitions through and holds the others until the driver is killed (or until a file
``open`` appears in the gate folder, which lets them through): the run stops
"midway" by count, not by timing, whatever order the executor delivers partitions in.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from nemo_curator.stages.base import ProcessingStage
from nemo_curator.tasks import DocumentBatch

PARTS = 3
# The partition whose every task DropSome filters: a source completed with no output at all.
ALL_DROPPED = "in-03.jsonl"
# A held partition gives up after this long, in case nobody kills the run.
_HOLD_S = 600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def source_file(task: DocumentBatch) -> str:
    return Path(task._metadata["source_files"][0]).name


@dataclass
class FanOut(ProcessingStage[DocumentBatch, DocumentBatch]):
    """1 → ``PARTS``: copy ``k`` of a partition's records gets ``part = k``."""

    seen_dir: str = ""
    gate_dir: str = ""
    pass_limit: int = -1  # -1: no limit
    # Set where the stage is built, i.e. in the driver: a held task ends when the driver is gone.
    driver_pid: int = field(default_factory=os.getpid)
    name: str = "fan_out"

    def process(self, task: DocumentBatch) -> list[DocumentBatch]:
        name = source_file(task)
        seen = Path(self.seen_dir)
        seen.mkdir(parents=True, exist_ok=True)
        (seen / name).write_text(json.dumps({"source_id": task._source_id}))
        if self.pass_limit >= 0 and not self._take_slot(name):
            deadline = time.monotonic() + _HOLD_S
            opened = Path(self.gate_dir) / "open"
            while time.monotonic() < deadline and _alive(self.driver_pid) and not opened.exists():
                time.sleep(0.2)
            if not opened.exists():
                os._exit(3)
        df = task.to_pandas()
        return [
            DocumentBatch(
                dataset_name=task.dataset_name,
                data=df.assign(part=k),
                _metadata=dict(task._metadata),
                _stage_perf=list(task._stage_perf),
            )
            for k in range(PARTS)
        ]

    def _take_slot(self, name: str) -> bool:
        # os.link fails on an existing name, which makes the slot files a cross-process counter:
        # the first pass_limit arrivals pass. A slot appears with its content, never empty.
        gate = Path(self.gate_dir)
        gate.mkdir(parents=True, exist_ok=True)
        claim = gate / f"claim-{name}"
        claim.write_text(name)
        for slot in range(self.pass_limit):
            try:
                os.link(claim, gate / f"slot-{slot}")
            except FileExistsError:
                continue
            return True
        (gate / f"held-{name}").touch()
        return False


@dataclass
class DropSome(ProcessingStage[DocumentBatch, DocumentBatch]):
    """Filter: drops part 1 of every partition, and every part of ``ALL_DROPPED``."""

    name: str = "drop_some"

    def process(self, task: DocumentBatch) -> DocumentBatch | None:
        parts = set(task.to_pandas()["part"])
        if parts == {1} or source_file(task) == ALL_DROPPED:
            return None
        return task

"""Traces and their replay through the counting rules (``tally replay TRACE``; no coordinator needed).

A trace is a JSONL file, one call per line, written by ``client.writer(..., trace=PATH)``, the
``TALLY_TRACE`` variable, or ``tally_for_nemo_curator(..., trace=PATH)``; NeMo Curator 1.4.0's own
actor calls recorded the same way are traces too (``tests/fixtures/``). Each row has ``method`` and:

- ``seq`` (the row's number in its writer's trace), ``at`` (seconds since the epoch, when the call
  returned or the answer arrived) and ``writer`` (the writer id asked for): written by Tally,
  optional on reading;
- ``wait``: ``result``, the sources completed when the writer opened;
- ``open``: ``checkpoint``, ``writer_id``, ``completed_at_open`` and ``settle_ms`` (the coordinator's
  settle window);
- ``are_completed``: ``source_ids`` and ``result`` (one bool each);
- ``acquire``: ``source_ids`` and ``states`` (``acquired``, ``held``, ``completed``, ``failed``);
- ``apply_deltas``: ``per_task``, the ``[task_id, source_id, delta]`` triples of the call;
  ``newly_completed``, what NeMo Curator's actor completed on that call (NeMo Curator recordings
  only); ``continued`` when a call that waited for room in the writer's buffer was taken in parts;
  ``error`` when the writer refused the call;
- ``batch``: what the coordinator answered for one batch the writer sent: ``batch_seq``, ``deltas``
  (how many: the next ones of the ``apply_deltas`` rows, in order), ``counts`` (``applied``,
  ``skipped``, ``rewritten``, ``anomalies``, ``completed``), ``refused``, ``settled``; batch rows
  come in the order the coordinator applied the batches (a writer with two on the wire records
  an answer that came back early once the one before it is in; replay puts rows of older SDKs,
  recorded as the answers came, back in ``batch_seq`` order);
- ``close``: NeMo Curator's ``pending`` and ``completed`` at the end, or the writer's totals as the
  coordinator reported them (``counts``, ``incomplete_count``, ``incomplete_sources``), or ``error``.

Tally's writer batches deltas, and the coordinator applies *batches*, not calls, and reports how many
sources each batch completed without naming them; so a trace recorded by Tally has no
``newly_completed``: its ``batch`` rows carry what the coordinator said. A trace with ``open`` or
``batch`` rows is replayed batch by batch, exactly as the coordinator saw the deltas, and each batch's
completions are checked against the count it reported (at ``settle_ms`` 0; with a settle window the
coordinator completes sources later, so only the totals at close are checked). A trace without them
(NeMo Curator's actor) is replayed call by call and checked against ``newly_completed``.

The rules here (:class:`Rules`) are a small, pure restatement of the coordinator's (README, "The
counting rules"), with settle window 0: NeMo Curator's actor, apart from Tally's one documented
difference (a source completes only if its count is still zero at the end of the batch). Sources
answered completed by ``are_completed`` (or ``acquire``) before the run's first delta count as
completed before the writer opened: a delta for one of them is an anomaly, as on the coordinator.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Delta = tuple[str, str, int]

METHODS = ("wait", "open", "are_completed", "acquire", "apply_deltas", "batch", "close")
COUNTS = ("applied", "skipped", "rewritten", "anomalies", "completed")


class TraceError(ValueError):
    """A trace line that is not a valid row; ``line`` is its 1-based number in the file."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}, line {line}: {message}")
        self.path = path
        self.line = line


# --------------------------------------------------------------------------- the counting rules


@dataclass
class Anomaly:
    """A delta for a source completed for this writer: not applied, and the source is un-completed."""

    task_id: str
    source_id: str
    old_delta: int | None
    new_delta: int


@dataclass
class Outcome:
    """What one batch did: the sources it completed (in order), its anomalies, its counters."""

    completed: list[str] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))


class Rules:
    """One writer's counting rules at settle window 0, on plain dicts.

    Args:
        completed_before: Sources completed before the writer opened (by earlier runs or others).
    """

    def __init__(self, completed_before: Iterable[str] = ()) -> None:
        self.before: set[str] = set(completed_before)
        self.pending: dict[str, int] = {}  # source -> sum of its applied deltas, while not zero
        self.applied: dict[str, int] = {}  # task id -> the delta applied for it
        self.own: set[str] = set()  # completed by this writer
        self.uncompleted: set[str] = set()  # un-completed by an anomaly of this writer
        self.totals: dict[str, int] = dict.fromkeys(COUNTS, 0)

    def is_completed(self, source_id: str) -> bool:
        """Completed for this writer: by it, or before it opened and not un-completed since."""
        return source_id in self.own or (source_id not in self.uncompleted and source_id in self.before)

    def completed(self) -> set[str]:
        """Every source completed for this writer."""
        return self.own | (self.before - self.uncompleted)

    def apply(self, batch: Iterable[Delta]) -> Outcome:
        """Apply one batch, in order.

        Per delta: a task id seen with the same delta is skipped (a retry); a delta for a source
        completed for this writer is an anomaly (not applied; the source is un-completed); else the
        delta replaces the task id's earlier one (rewritten) or is added (applied) to its source's
        count. At the end of the batch, each source whose count moved to zero in it and is still
        zero completes, in the order they first reached zero.
        """
        out = Outcome()
        counts = out.counts
        recheck: dict[str, None] = {}
        for task_id, sid, d in batch:
            old = self.applied.get(task_id)
            if old == d:
                counts["skipped"] += 1
                continue
            if self.is_completed(sid):
                counts["anomalies"] += 1
                out.anomalies.append(Anomaly(task_id, sid, old, d))
                self.own.discard(sid)
                self.uncompleted.add(sid)
                continue
            self.applied[task_id] = d
            count = self.pending.get(sid, 0) + d - (old or 0)
            counts["applied" if old is None else "rewritten"] += 1
            self.pending[sid] = count
            if not count:
                recheck[sid] = None
        for sid in recheck:
            if self.pending.get(sid) == 0:
                del self.pending[sid]
                self.own.add(sid)
                out.completed.append(sid)
        counts["completed"] = len(out.completed)
        for name in COUNTS:
            self.totals[name] += counts[name]
        return out


# --------------------------------------------------------------------------- reading


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_list(row: dict[str, Any], name: str) -> str | None:
    value = row.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return f"{name!r} must be a list of strings, got {value!r:.200}"
    return None


def _check_row(row: Any) -> str | None:  # noqa: C901 - one branch per method, flat
    """Why ``row`` is not a valid trace row, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    method = row.get("method")
    if method not in METHODS:
        return f"'method' must be one of {', '.join(METHODS)}, got {method!r:.100}"
    if "seq" in row and not _is_int(row["seq"]):
        return f"'seq' must be an integer, got {row['seq']!r:.100}"
    if "at" in row and (not isinstance(row["at"], int | float) or isinstance(row["at"], bool)):
        return f"'at' must be a number (seconds since the epoch), got {row['at']!r:.100}"
    if "writer" in row and not isinstance(row["writer"], str):
        return f"'writer' must be a string, got {row['writer']!r:.100}"
    if method == "apply_deltas":
        per_task = row.get("per_task")
        if not isinstance(per_task, list):
            return f"'per_task' must be a list of [task_id, source_id, delta], got {per_task!r:.200}"
        for i, item in enumerate(per_task):
            if not (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and isinstance(item[1], str)
                and _is_int(item[2])
            ):
                return (
                    f"per_task[{i}] must be [task_id, source_id, delta] (two strings, an integer), "
                    f"got {item!r:.200}"
                )
        if "newly_completed" in row:
            return _str_list(row, "newly_completed")
    elif method in ("are_completed", "acquire"):
        bad = _str_list(row, "source_ids")
        if bad:
            return bad
        name, kind = ("result", bool) if method == "are_completed" else ("states", str)
        values = row.get(name)
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            return f"{name!r} must be a list of {kind.__name__}s, got {values!r:.200}"
        if len(values) != len(row["source_ids"]):
            return f"{name!r} has {len(values)} entries for {len(row['source_ids'])} source_ids"
    elif method == "batch":
        if not _is_int(row.get("deltas")) or row["deltas"] < 0:
            return f"'deltas' must be a count of deltas, got {row.get('deltas')!r:.100}"
        return _check_counts(row)
    elif method == "open":
        if "settle_ms" in row and (not _is_int(row["settle_ms"]) or row["settle_ms"] < 0):
            return f"'settle_ms' must be a non-negative integer, got {row['settle_ms']!r:.100}"
    elif method == "close":
        if "completed" in row:
            bad = _str_list(row, "completed")
            if bad:
                return bad
        if "pending" in row and not isinstance(row["pending"], dict):
            return f"'pending' must be an object of source id -> count, got {row['pending']!r:.200}"
        if "counts" in row:
            return _check_counts(row)
    return None


def _check_counts(row: dict[str, Any]) -> str | None:
    counts = row.get("counts")
    if not isinstance(counts, dict) or not all(_is_int(counts.get(name, 0)) for name in COUNTS):
        return f"'counts' must be an object of integer counters ({', '.join(COUNTS)}), got {counts!r:.200}"
    if "refused" in row and not _is_int(row["refused"]):
        return f"'refused' must be an integer, got {row['refused']!r:.100}"
    return None


@dataclass
class Row:
    """One trace line: its number in the file and its fields."""

    line: int
    data: dict[str, Any]

    @property
    def method(self) -> str:
        return str(self.data["method"])


def read_trace(path: str | os.PathLike[str]) -> list[Row]:
    """Read and check every row of a trace file (blank lines are skipped).

    Raises:
        OSError: The file cannot be read.
        TraceError: A line is not JSON or not a valid row; the error names the line.
    """
    name = os.fspath(path)
    rows = []
    with open(name, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                why = (
                    "the line is cut short (a trace of a process that was killed?)"
                    if not text.endswith("\n")
                    else ""
                )
                raise TraceError(
                    name,
                    number,
                    f"not a JSON object: {exc.msg} at column {exc.colno}{'; ' + why if why else ''}",
                ) from None
            bad = _check_row(data)
            if bad:
                raise TraceError(name, number, bad)
            rows.append(Row(number, data))
    return rows


# --------------------------------------------------------------------------- replay


@dataclass
class Step:
    """One row replayed: what the rules completed there, and whether that differs from the trace."""

    line: int
    seq: int | None
    at: float | None
    method: str
    deltas: int  # deltas of the row (apply_deltas, batch)
    completed: list[str]  # what the rules completed at this row
    anomalies: list[Anomaly] = field(default_factory=list)
    recorded: Any = None  # what the trace says was completed here, when it says so
    mismatch: str | None = None
    note: str | None = None
    detail: str = ""  # the row's call in a few words, for people


@dataclass
class Run:
    """One writer's session in a trace, replayed."""

    writer: str | None
    checkpoint: str | None = None
    settle_ms: int | None = None
    mode: Literal["call", "batch"] = "call"
    steps: list[Step] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # by the rules, in order
    pending: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    undelivered: int = 0  # recorded deltas no batch row says were sent

    @property
    def mismatches(self) -> list[Step]:
        return [step for step in self.steps if step.mismatch]


def split_runs(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows grouped by writer (in order of first appearance). A writer id used again (a rerun
    appending to the same file) starts a new run after a ``close`` row, or at a second ``open``."""
    runs: list[list[Row]] = []
    current: dict[str | None, list[Row]] = {}
    for row in rows:
        key = row.data.get("writer")
        run = current.get(key)
        ended = run is not None and (
            run[-1].method == "close" or (row.method == "open" and any(r.method == "open" for r in run))
        )
        if run is None or ended:
            run = []
            runs.append(run)
            current[key] = run
        run.append(row)
    return runs


def replay(rows: Sequence[Row]) -> list[Run]:
    """Replay every run of a trace through :class:`Rules`."""
    return [_replay_run(run) for run in split_runs(rows)]


def _in_applied_order(rows: Sequence[Row]) -> tuple[list[Row], set[int]]:
    """``rows`` with the batch rows in ``batch_seq`` order, each in the place of one of them, and
    the lines of those moved.

    The coordinator applies a writer's batches in that order. A writer with two batches on the
    wire records an answer that came back early once the one before it is in; SDKs before that
    fix recorded answers as they came, which replay would otherwise take as mismatches.
    """
    places = [i for i, row in enumerate(rows) if row.method == "batch"]
    batches = [rows[i] for i in places]
    if not all(isinstance(row.data.get("batch_seq"), int) for row in batches):
        return list(rows), set()
    ordered = sorted(batches, key=lambda row: row.data["batch_seq"])
    out = list(rows)
    moved: set[int] = set()
    for i, row in zip(places, ordered, strict=True):
        if rows[i] is not row:
            moved.add(row.line)
        out[i] = row
    return out, moved


def _replay_run(rows: Sequence[Row]) -> Run:
    batched = any(row.method in ("open", "batch") for row in rows)
    rows, moved = _in_applied_order(rows)
    run = Run(writer=rows[0].data.get("writer"), mode="batch" if batched else "call")
    rules = Rules()
    queue: deque[Delta] = deque()  # recorded deltas not yet in a batch row (batch mode)
    started = False  # a delta was applied: later are_completed answers are not "before open"
    for row in rows:
        data, method = row.data, row.method
        step = Step(row.line, data.get("seq"), data.get("at"), method, 0, [])
        if method == "wait" and "result" in data:
            step.detail = f"{data['result']} completed at open"
        if method == "open":
            step.detail = f"{data.get('completed_at_open', '?')} completed at open"
            run.checkpoint = data.get("checkpoint")
            run.settle_ms = data.get("settle_ms")
            run.writer = data.get("writer_id", run.writer)
        elif method in ("are_completed", "acquire"):
            answers = (
                data["result"] if method == "are_completed" else [s == "completed" for s in data["states"]]
            )
            step.detail = f"{len(answers)} sources, {sum(answers)} completed"
            for sid, done in zip(data["source_ids"], answers, strict=True):
                if done and not rules.is_completed(sid) and not started:
                    rules.before.add(sid)
                elif not done and sid in rules.own and run.mode == "call":
                    step.mismatch = f"answered {sid!r} not completed, but the rules completed it"
        elif method == "apply_deltas":
            deltas: list[Delta] = [(t, s, d) for t, s, d in data["per_task"]]
            step.deltas = len(deltas)
            if "error" in data:
                step.note = f"refused by the writer: {data['error']}"
            elif run.mode == "batch":
                queue.extend(deltas)
                step.note = "buffered by the writer"
            else:
                started = started or bool(deltas)
                _applied(step, rules.apply(deltas), run)
                if "newly_completed" in data:
                    step.recorded = data["newly_completed"]
                    if sorted(step.completed) != sorted(step.recorded):
                        step.mismatch = (
                            f"newly_completed is {sorted(step.recorded)}, "
                            f"the rules complete {sorted(step.completed)}"
                        )
        elif method == "batch":
            _replay_batch(step, data, queue, rules, run)
            started = started or step.deltas > 0
            if row.line in moved:
                reorder = "replayed in batch_seq order (its answer was recorded out of that order)"
                step.note = f"{step.note}; {reorder}" if step.note else reorder
        elif method == "close":
            _replay_close(step, data, rules, run, queue)
        run.steps.append(step)
    run.undelivered = len(queue) if run.mode == "batch" else 0
    run.pending = dict(rules.pending)
    run.counts = dict(rules.totals)
    return run


def _applied(step: Step, outcome: Outcome, run: Run) -> None:
    step.completed = outcome.completed
    step.anomalies = outcome.anomalies
    run.completed += outcome.completed


def _replay_batch(step: Step, data: dict[str, Any], queue: deque[Delta], rules: Rules, run: Run) -> None:
    want = data["deltas"]
    step.deltas = want
    if want > len(queue):
        step.mismatch = (
            f"the batch has {want} deltas, but only {len(queue)} recorded deltas were not sent yet"
        )
    batch = [queue.popleft() for _ in range(min(want, len(queue)))]
    _applied(step, rules.apply(batch), run)
    reported = int(data["counts"].get("completed", 0))
    step.recorded = reported
    if step.mismatch:
        return
    refused = int(data.get("refused", 0))
    if refused:
        step.note = (
            f"the coordinator refused {refused} deltas (another writer's claim); the rules applied "
            "all, so not compared"
        )
    elif run.settle_ms == 0:
        if reported != len(step.completed):
            step.mismatch = (
                f"the coordinator completed {reported} sources, the rules complete {len(step.completed)}"
            )
    elif reported != len(step.completed):
        window = "an unknown" if run.settle_ms is None else f"a {run.settle_ms} ms"
        step.note = (
            f"the coordinator completed {reported} here; it has {window} settle window, so sources complete "
            "later than the rules say: compared at close"
        )


def _replay_close(step: Step, data: dict[str, Any], rules: Rules, run: Run, queue: deque[Delta]) -> None:
    problems = []
    if "completed" in data:  # NeMo Curator's actor: its completed set at the end
        step.recorded = data["completed"]
        step.detail = f"{len(data['completed'])} completed"
        if sorted(data["completed"]) != sorted(rules.completed()):
            problems.append(
                f"completed is {sorted(data['completed'])}, the rules have {sorted(rules.completed())}"
            )
    if "pending" in data:
        if {k: v for k, v in data["pending"].items() if v} != rules.pending:
            problems.append(f"pending is {data['pending']}, the rules have {rules.pending}")
    if "counts" in data:  # the writer's totals, as the coordinator reported them at close
        reported = int(data["counts"].get("completed", 0))
        step.recorded = reported
        step.detail = f"coordinator: {reported} completed, {data.get('incomplete_count', '?')} incomplete"
        if reported != rules.totals["completed"]:
            problems.append(
                f"the coordinator completed {reported} sources in all, "
                f"the rules complete {rules.totals['completed']}"
            )
        if "incomplete_count" in data and data["incomplete_count"] != len(rules.pending):
            problems.append(
                f"the coordinator left {data['incomplete_count']} sources incomplete, "
                f"the rules {len(rules.pending)}"
            )
    if "error" in data:
        step.note = f"close failed: {data['error']}"
    if queue:
        extra = f"{len(queue)} recorded deltas were never delivered (the writer stopped or close timed out)"
        step.note = f"{step.note}; {extra}" if step.note else extra
    if problems:
        step.mismatch = "; ".join(problems)

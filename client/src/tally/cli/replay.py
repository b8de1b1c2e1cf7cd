"""``tally replay TRACE``: run a recorded trace through the counting rules; no coordinator needed."""

from __future__ import annotations

import pathlib
from typing import Annotated, Any, NoReturn

import typer

from tally.cli.common import Output, OutputFormat, count, emit_json, err, out, plain
from tally.replay import Run, Step, TraceError, read_trace
from tally.replay import replay as replay_rows

# Exit codes: 0 the trace agrees with the rules, 1 some rows differ, 2 the trace cannot be read.
EXIT_MISMATCH = 1
EXIT_UNREADABLE = 2


def replay(
    trace: Annotated[
        pathlib.Path,
        typer.Argument(
            help="The JSONL trace: client.writer(..., trace=PATH), TALLY_TRACE or the NeMo Curator "
            "drop-in's trace=."
        ),
    ],
    output: OutputFormat = Output.TABLE,
) -> None:
    """Offline: a recorded trace through the counting rules: what they complete, what differs.

    A trace Tally recorded is replayed batch by batch, as the coordinator
    received it; each batch is checked against how many sources the coordinator
    said it completed (at settle window 0; else the totals at close). A NeMo
    Curator recording is replayed call by call, checked against newly_completed.

    Exit status: 0 all agree; 1 some rows differ (flagged DIFFERS); 2 the trace
    cannot be read (the error names the line). -o json: one object: trace, runs
    (steps, summary), mismatches; -o wide also lists the calls between batches.
    """
    try:
        runs = replay_rows(read_trace(trace))
    except TraceError as exc:
        _unreadable(
            f"{exc}; a trace has one JSON object per line, as Tally writes it (see `tally replay --help`)"
        )
    except (OSError, UnicodeError) as exc:
        _unreadable(f"cannot read the trace {str(trace)!r}: {exc}")
    mismatches = sum(len(run.mismatches) for run in runs)
    if output is Output.JSON:
        emit_json({"trace": str(trace), "runs": [_run_json(run) for run in runs], "mismatches": mismatches})
    else:
        if not runs:
            out.print(f"{trace}: no calls recorded", markup=False)
        for run in runs:
            _print_run(run, wide=output is Output.WIDE)
    if mismatches:
        err.print(
            f"error: {count(mismatches, 'row')} of {trace} differ from what the counting rules complete "
            "(flagged DIFFERS above)",
            style="red",
            markup=False,
        )
        raise typer.Exit(EXIT_MISMATCH)


def _unreadable(message: str) -> NoReturn:
    err.print(f"error: {message}", style="red", markup=False)
    raise typer.Exit(EXIT_UNREADABLE)


def _run_json(run: Run) -> dict[str, Any]:
    return {
        "writer": run.writer,
        "checkpoint": run.checkpoint,
        "settle_ms": run.settle_ms,
        "mode": run.mode,
        "steps": [plain(step) for step in run.steps],
        "summary": _summary(run),
    }


def _summary(run: Run) -> dict[str, Any]:
    return {
        "completed": run.completed,
        "pending": run.pending,
        "counts": run.counts,
        "undelivered": run.undelivered,
        "mismatches": len(run.mismatches),
    }


def _print_run(run: Run, *, wide: bool) -> None:
    who = run.writer or "(no writer id)"
    where = f" on {run.checkpoint}" if run.checkpoint else ""
    settle = "" if run.settle_ms is None else f", settle window {run.settle_ms} ms"
    how = "batch by batch, as the coordinator received them" if run.mode == "batch" else "call by call"
    out.print(f"writer {who}{where}{settle}: replayed {how}", markup=False)
    for step in run.steps:
        if step.method == "apply_deltas" and run.mode == "batch" and not wide and not step.mismatch:
            continue  # buffered calls: the batches say what happened (-o wide lists them)
        out.print(_line(step), markup=False)
    anomalies = run.counts.get("anomalies", 0)
    out.print(
        f"summary: {count(len(run.completed), 'source')} completed, "
        f"{count(len(run.pending), 'source')} pending, "
        f"{count(run.counts.get('applied', 0), 'delta')} applied, {run.counts.get('skipped', 0)} skipped, "
        f"{run.counts.get('rewritten', 0)} rewritten, {count(anomalies, 'anomaly', 'anomalies')}"
        + (f", {count(run.undelivered, 'delta')} never delivered" if run.undelivered else "")
        + f"; {count(len(run.mismatches), 'row')} differ",
        markup=False,
    )


def _line(step: Step) -> str:
    seq = "-" if step.seq is None else str(step.seq)
    what = step.method
    if step.method in ("apply_deltas", "batch"):
        what += f" ({count(step.deltas, 'delta')})"
    text = f"{seq:>6}  {what:<28}"
    if step.detail:
        text += f" {step.detail}"
    if step.method in ("apply_deltas", "batch") and not step.note == "buffered by the writer":
        text += " completes " + (", ".join(step.completed) if step.completed else "-")
    elif step.note == "buffered by the writer":
        text += " buffered"
    if step.anomalies:
        text += f"; {count(len(step.anomalies), 'anomaly', 'anomalies')}: " + ", ".join(
            f"{a.task_id}@{a.source_id}" for a in step.anomalies
        )
    if step.method == "batch" and step.recorded is not None:
        text += f" (coordinator: {step.recorded} completed)"
    if step.note and step.note != "buffered by the writer":
        text += f"  [{step.note}]"
    if step.mismatch:
        text += f"  DIFFERS (line {step.line}): {step.mismatch}"
    return text

"""Operator commands over a running coordinator: status, watch, remaining, writers, events, failed,
retry, reset.

Each talks to the coordinator through the SDK (``tally.Client``), exactly as any other client.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import tally
from tally._config import DEFAULT_ADDRESS, DEFAULT_TIMEOUT
from tally.cli.common import (
    Address,
    Output,
    OutputFormat,
    Timeout,
    Token,
    age,
    clock,
    connect,
    count,
    duration,
    emit_json,
    err,
    fail,
    out,
    pairs,
    writers_table,
)

# Window over which `tally watch` measures the completion rate.
_RATE_WINDOW_S = 60.0
#: Live writers ``tally status NAME`` lists (a checkpoint may have hundreds: ``tally writers`` pages them).
STATUS_WRITERS = 20


# --------------------------------------------------------------------------- status


def status(
    checkpoint: Annotated[str | None, typer.Argument(help="Checkpoint name; omit for all.")] = None,
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Checkpoints at a glance, or one checkpoint in detail.

    With CHECKPOINT, its first 20 live writers (by writer id; a line on stderr says when there are
    more, and `tally writers CHECKPOINT` lists them all).

    -o json: an array of checkpoints by name (their live writers counted, `writers` empty), or with
    CHECKPOINT one object (with all its writers).
    """
    with connect(address, token, timeout) as client:
        if checkpoint is None:
            found = sorted(client.checkpoints(writers=False), key=lambda c: c.name)
            if output == Output.JSON:
                emit_json(found)
            else:
                _status_all(found, wide=output == Output.WIDE)
        else:
            one = client.checkpoint(checkpoint)
            if output == Output.JSON:
                emit_json(one)
            else:
                _status_one(one, wide=output == Output.WIDE)


def _status_all(checkpoints: list[tally.CheckpointStatus], *, wide: bool) -> None:
    if not checkpoints:
        out.print("no checkpoints yet")
        return
    table = Table()
    table.add_column("checkpoint")
    for name in ("completed", "pending", "live writers", "anomalies", "unreadable files"):
        table.add_column(name, justify="right")
    if wide:
        for name in ("settling", "claimed", "max attempts", "total", "remaining"):
            table.add_column(name, justify="right")
    failures = wide or any(c.failed_sources for c in checkpoints)
    if failures:  # a column only when some checkpoint has failed sources
        table.add_column("failed", justify="right")
    totals = wide or any(c.total > 0 for c in checkpoints)
    if totals:  # a column only when some checkpoint has declared sources
        table.add_column("done", justify="right")
    table.add_column("last activity")
    if wide:
        for name in ("last activity at", "created at", "owner", "fingerprint"):
            table.add_column(name)
    for c in checkpoints:
        row: list[str | Text] = [
            c.name,
            str(c.completed_count),
            str(c.pending_sources),
            str(c.live_writers),
            _flag(c.anomalies),
            _flag(c.unreadable_files),
        ]
        if wide:
            row += [str(c.settling_sources), str(c.claimed_sources), str(c.max_attempts or "unlimited")]
            row += [str(c.total), "-" if c.remaining < 0 else str(c.remaining)]
        if failures:
            row.append(_flag(c.failed_sources))
        if totals:
            row.append("-" if c.percent is None else f"{c.percent:.1f} %")
        row.append(age(c.last_activity_at))
        if wide:
            row += [clock(c.last_activity_at, "milliseconds"), clock(c.created_at, "milliseconds")]
            row += [c.owner or "-", pairs(c.fingerprint) or "-"]
        table.add_row(*row)
    out.print(table)
    owners = sorted({c.owner for c in checkpoints if c.owner})
    if owners:  # a PostgreSQL store: the replica applying these checkpoints' deltas
        out.print(f"owner: {', '.join(owners)} (tally replicas lists every replica)")


def _flag(count: int) -> Text:
    # Anomalies and unreadable files are the things an operator must not miss.
    return Text(str(count), style="bold red" if count else "")


def _status_one(c: tally.CheckpointStatus, *, wide: bool) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("checkpoint", c.name)
    grid.add_row("completed", str(c.completed_count))
    if wide and c.percent is None:
        grid.add_row("total", "none declared")
    if c.percent is not None:  # a declared total (client.declare): how far along, what is left
        grid.add_row("total", f"{c.total} declared ({c.percent:.1f} % completed)")
        left = "unknown (a count was declared)" if c.remaining < 0 else str(c.remaining)
        hint = f" (tally remaining {c.name} lists them)" if c.remaining > 0 else ""
        grid.add_row("remaining", left + hint)
    grid.add_row("pending", str(c.pending_sources))
    grid.add_row("settling", str(c.settling_sources))
    grid.add_row("live writers", str(c.live_writers))
    if c.claimed_sources or wide:
        grid.add_row("claimed", f"{count(c.claimed_sources, 'source')} held by live writers")
    grid.add_row("anomalies", _flag(c.anomalies))
    grid.add_row("unreadable files", _flag(c.unreadable_files))
    spec = "milliseconds" if wide else "seconds"
    grid.add_row("created", f"{clock(c.created_at, spec)} ({age(c.created_at)})")
    grid.add_row("last activity", f"{clock(c.last_activity_at, spec)} ({age(c.last_activity_at)})")
    grid.add_row("fingerprint", pairs(c.fingerprint) or "-")
    if c.max_attempts or c.failed_sources or wide:
        hint = f" (tally failed {c.name} lists them)" if c.failed_sources else ""
        grid.add_row(
            "failed", Text(str(c.failed_sources), style="bold red" if c.failed_sources else "").append(hint)
        )
        grid.add_row("max attempts", str(c.max_attempts) if c.max_attempts else "unlimited")
    if c.owner:
        grid.add_row("owner", f"{c.owner} (the replica applying its deltas; tally replicas lists all)")
    elif wide:
        grid.add_row("owner", "- (one coordinator on LMDB files)")
    out.print(grid)
    if c.writers:
        out.print(writers_table(c.writers[:STATUS_WRITERS], title="live writers", wide=wide))
    if len(c.writers) > STATUS_WRITERS:
        err.print(
            f"the first {STATUS_WRITERS} of {count(len(c.writers), 'live writer')} shown; "
            f"tally writers {c.name} --limit {len(c.writers)} lists them all"
        )


# --------------------------------------------------------------------------- replicas


def replicas(
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """The coordinators serving a PostgreSQL store: which owns it, which are replicas.

    -o json: one object, the store: its replicas (an array, empty on LMDB files), epoch, answered_by.
    """
    with connect(address, token, timeout) as client:
        found = client.replicas()
    if output == Output.JSON:
        emit_json(found)
        return
    if not found.replicas:
        out.print("one coordinator, no replicas (the LMDB store; replicas need --store postgresql://...)")
        return
    wide = output == Output.WIDE
    table = Table()
    for name in ("replica", "role", "grpc", "http", "started", "last seen"):
        table.add_column(name)
    if wide:
        for name in ("started at", "silent s"):
            table.add_column(name)
    for r in found.replicas:
        row: list[str | Text] = [
            r.name,
            Text(_role(r), style="bold") if r.owner else "replica",
            r.grpc_address,
            r.http_address,
            age(r.started_at),
            Text(duration(r.silent_s) + " ago", style="" if r.silent_s < 5 else "bold red"),
        ]
        if wide:
            row += [clock(r.started_at, "milliseconds"), f"{r.silent_s:.3f}"]
        table.add_row(*row)
    out.print(table)
    out.print(f"store epoch {found.epoch}; answered by {found.answered_by}")


def _role(r: tally.Replica) -> str:
    """``owner``, or on a store of several shards ``owns 0,2`` (compact: it fits 80 columns)."""
    return "owns " + ",".join(map(str, r.shards)) if r.shards else "owner"


# --------------------------------------------------------------------------- watch


@dataclass
class RateMeter:
    """Completions per second from successive snapshots, over a sliding window."""

    window_s: float = _RATE_WINDOW_S

    def __post_init__(self) -> None:
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, at: float, completed: int) -> None:
        if self._points and completed < self._points[-1][1]:
            self._points.clear()  # the checkpoint was reset (or un-completed): start over
        self._points.append((at, completed))
        while len(self._points) > 2 and at - self._points[1][0] >= self.window_s:
            self._points.popleft()

    def rate(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t0, c0), (t1, c1) = self._points[0], self._points[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def _left(s: tally.CheckpointStatus) -> int:
    """Declared sources not completed: the coordinator's count, or the total less the completed."""
    return s.remaining if s.remaining >= 0 else max(0, s.total - s.completed_count)


def eta(s: tally.CheckpointStatus, rate: float | None) -> str | None:
    """Time left at ``rate``, only with a declared total (None otherwise: no ETA is honest)."""
    if s.total <= 0:
        return None
    left = _left(s)
    if left == 0:
        return "done"
    if rate is None or rate <= 0:
        return "unknown"
    return duration(left / rate)


def progress_line(s: tally.CheckpointStatus, rate: float | None) -> str:
    """Count, rate and what is in flight; a percent and an ETA only when a total was declared.

    Without one, completed plus pending is not the total (sources not started yet are in
    neither), so a bar or an ETA drawn from them would say "almost done" early in every run.
    """
    rate_text = "unknown" if rate is None else f"{rate:.2f}/s"
    failed = f"  failed {s.failed_sources}" if s.failed_sources else ""
    completed = str(s.completed_count)
    tail = ""
    if s.percent is not None:
        completed += f" of {s.total} ({s.percent:.1f} %)"
        tail = f"  remaining {_left(s)}  ETA {eta(s, rate)}"
    return (
        f"{s.name}: completed {completed}  pending {s.pending_sources}  "
        f"live writers {s.live_writers}  anomalies {s.anomalies}{failed}  rate {rate_text}{tail}"
    )


def _progress_view(s: tally.CheckpointStatus, rate: float | None) -> Text | Group:
    if s.percent is None:
        return Text(progress_line(s, rate))
    # A declared total: a bar (rich.progress's) with the percent and the ETA beside it.
    head = Table.grid(padding=(0, 1))
    bar = ProgressBar(total=s.total, completed=min(s.completed_count, s.total), width=40)
    head.add_row(bar, Text(f"{s.percent:.1f} %  ETA {eta(s, rate)}", style="bold"))
    return Group(head, Text(progress_line(s, rate)))


def watch(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    max_updates: Annotated[
        int | None, typer.Option("--max-updates", min=1, help="Exit after this many snapshots.")
    ] = None,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between updates.")] = 1.0,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Live progress of a checkpoint: completed, pending (in flight), rate.

    A bar, a percent and an ETA only when the checkpoint's sources were declared
    (client.declare); without a total, completed + pending is not one, so none is drawn.
    """
    meter = RateMeter()
    with connect(address, token, timeout) as client:
        if once:
            out.print(progress_line(client.checkpoint(checkpoint), None))
            return
        stream = client.watch(checkpoint, interval_s=interval)
        try:
            if out.is_terminal:
                with Live(console=out, auto_refresh=False) as live:
                    for n, snapshot in enumerate(stream, 1):
                        meter.add(time.monotonic(), snapshot.completed_count)
                        live.update(_progress_view(snapshot, meter.rate()), refresh=True)
                        if max_updates is not None and n >= max_updates:
                            break
            else:
                # Not a terminal (a log, a pipe): one line per snapshot instead of a redrawn bar.
                for n, snapshot in enumerate(stream, 1):
                    meter.add(time.monotonic(), snapshot.completed_count)
                    out.print(progress_line(snapshot, meter.rate()))
                    if max_updates is not None and n >= max_updates:
                        break
        except KeyboardInterrupt:
            pass
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()


# --------------------------------------------------------------------------- remaining


def remaining(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Most ids printed.")] = None,
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Declared sources not completed yet, one id per line (for a pipe); a count on stderr.

    -o json: one array of the ids; -o wide is the default (an id is the only column).
    """
    listed: list[str] = []  # -o json: the ids, printed as one array at the end
    shown = 0
    more = False
    with connect(address, token, timeout) as client:
        current = client.checkpoint(checkpoint)
        ids = client.remaining(checkpoint, page_size=min(limit, 1000) if limit else 1000)
        try:
            for sid in ids:
                if limit is not None and shown >= limit:
                    more = True
                    break
                if output == Output.JSON:
                    listed.append(sid)
                else:
                    # Plain print: an id is never wrapped, styled or cut, whatever the terminal.
                    print(sid)
                shown += 1
            sys.stdout.flush()
        except BrokenPipeError:  # `tally remaining cp | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
    if output == Output.JSON:
        emit_json(listed)
    if current.total <= 0:
        err.print(f"{checkpoint}: no sources declared (client.declare or writer(expected_sources=))")
    elif shown == 0 and current.remaining < 0:
        err.print(
            f"{checkpoint}: {count(current.total, 'source')} declared as a count: their ids are not known"
        )
    elif more:
        left = (
            f"{shown} of {count(current.remaining, 'remaining source')}"
            if current.remaining >= 0
            else count(shown, "remaining source")
        )
        err.print(f"{left} of {checkpoint} (--limit {limit})")
    else:
        err.print(f"{count(shown, 'remaining source')} of {checkpoint} (of {current.total} declared)")


# --------------------------------------------------------------------------- writers, events


def writers(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    all_: Annotated[
        bool, typer.Option("--all", help="Also writers that closed, expired or were lost.")
    ] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Most writers shown.")] = 100,
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Writers of a checkpoint: host, pid, labels (SLURM ids), heartbeat age, counts.

    Live writers first (by writer id), then with --all the ended ones, newest first. When there
    are more than --limit, a line on stderr says so.

    -o json: an array of writers; -o wide adds every count and the times in full.
    """
    with connect(address, token, timeout) as client:
        found = client.writers(checkpoint, include_closed=all_, limit=limit + 1)
    more, found = len(found) > limit, found[:limit]
    if output == Output.JSON:
        emit_json(found)
    elif not found:
        out.print(f"no {'' if all_ else 'live '}writers in {checkpoint}")
    else:
        out.print(writers_table(found, closed=all_, wide=output == Output.WIDE))
    if more:
        also = " --all" if all_ else ""
        err.print(
            f"the first {count(limit, 'writer')} shown; there are more: "
            f"tally writers {checkpoint}{also} --limit {limit * 10}"
        )


def events(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    limit: Annotated[int, typer.Option("--limit", min=1, help="Most events shown.")] = 50,
    before: Annotated[
        int | None, typer.Option("--before", min=1, help="Only events older than this id (paging).")
    ] = None,
    severity: Annotated[
        tally.Severity,
        typer.Option("--severity", case_sensitive=False, help="Only events of this severity or worse."),
    ] = tally.Severity.INFO,
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Events of a checkpoint, newest first: anomalies, unreadable files, writers, resets.

    -o json: an array of events, newest first (older ones: --before the last one's id).
    """
    with connect(address, token, timeout) as client:
        shown, older = _events_at_least(client, checkpoint, severity, limit, before)
    also = "" if severity == tally.Severity.INFO else f" --severity {severity}"
    if output == Output.JSON:
        emit_json(shown)
        if older is not None:
            err.print(f"older events: tally events {checkpoint} --before {older}{also} -o json")
        return
    spec = "milliseconds" if output == Output.WIDE else "seconds"
    if not shown:
        worse = "" if severity == tally.Severity.INFO else f" of severity {severity} or worse"
        out.print(f"no events{worse} in {checkpoint}")
        return
    table = Table()
    table.add_column("id", justify="right")
    for name in ("time", "severity", "kind", "writer", "message", "data"):
        table.add_column(name)
    for e in shown:
        style = _SEVERITY_STYLE.get(e.severity, "")
        table.add_row(
            str(e.id),
            clock(e.at, spec),
            Text(e.severity, style=style),
            Text(e.kind, style=style),
            e.writer_id or "-",
            e.message,
            pairs(e.data),
        )
    out.print(table)
    if older is not None:
        out.print(f"older events: tally events {checkpoint} --before {older}{also}")


_SEVERITY_STYLE = {tally.Severity.ERROR: "red", tally.Severity.WARNING: "yellow"}
# Filtering by severity happens here, reading the log newest first in pages of the most the server gives.
_SCAN_PAGE = 1000


def _events_at_least(
    client: tally.Client, checkpoint: str, minimum: tally.Severity, limit: int, before: int | None
) -> tuple[list[tally.Event], int | None]:
    """Up to ``limit`` events of ``minimum`` severity or worse, and the ``--before`` of the next ones."""
    if minimum == tally.Severity.INFO:
        page = client.events(checkpoint, limit=limit, before_id=before)
        return list(page.events), page.next_before_id
    found: list[tally.Event] = []
    while True:
        page = client.events(checkpoint, limit=_SCAN_PAGE, before_id=before)
        for e in page.events:
            if e.severity.at_least(minimum):
                if len(found) == limit:  # one more exists: there is an older page
                    return found, found[-1].id
                found.append(e)
        if page.next_before_id is None:
            return found, None
        before = page.next_before_id


# --------------------------------------------------------------------------- failed, retry

# Reasons shown per source by `tally failed` (newest first); --json gives every one kept.
_REASONS_SHOWN = 3


def _one_line(reason: str) -> str:
    # A reason may be a traceback: one table row per source, whatever it holds.
    return " ".join(reason.split()) or "(no reason given)"


def failed(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    all_: Annotated[
        bool,
        typer.Option("--all", help="Every source with a failed attempt, not only those at the budget."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="JSON Lines: one object per source and line, with every reason kept."),
    ] = False,
    output: OutputFormat = Output.TABLE,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Failed sources of a checkpoint (max_attempts failed attempts): attempts and latest reasons.

    -o json: one array of sources, each with every reason kept; -o wide shows every reason kept.
    """
    if as_json and output != Output.TABLE:
        raise fail(f"--json (one object per line) and -o {output} are two outputs: give one of them")
    with connect(address, token, timeout) as client:
        current = client.checkpoint(checkpoint)
        found = list(client.failures(checkpoint, failed_only=not all_))
    if output == Output.JSON:
        emit_json(found)
        return
    wide = output == Output.WIDE
    if as_json:
        for f in found:
            recent = [{"reason": a.reason, "at": a.at, "writer_id": a.writer_id} for a in f.recent]
            line = {"source_id": f.source_id, "attempts": f.attempts, "failed": f.failed, "recent": recent}
            out.print(json.dumps(line), markup=False, soft_wrap=True)
        return
    budget = (
        f"max attempts {current.max_attempts}" if current.max_attempts else "no failure budget (unlimited)"
    )
    if not found:
        if all_:
            out.print(f"no failed attempts in {checkpoint} ({budget})")
        elif current.max_attempts:
            out.print(
                f"no failed sources in {checkpoint} ({budget}; tally failed --all shows any failed attempt)"
            )
        else:
            out.print(
                f"no failed sources in {checkpoint}: it has {budget}, so no source fails; "
                "set one with client.set_max_attempts() or client.writer(..., max_attempts=n)"
            )
        return
    table = Table()
    table.add_column("source")
    table.add_column("attempts", justify="right")
    if all_ or wide:
        table.add_column("failed")
    table.add_column("last attempt")
    if wide:
        table.add_column("last attempt at")
    for name in ("writer", "every reason kept (newest first)" if wide else "latest reasons (newest first)"):
        table.add_column(name)
    for f in found:
        last = f.recent[-1] if f.recent else None
        kept = f.recent if wide else f.recent[-_REASONS_SHOWN:]
        reasons = " | ".join(_one_line(a.reason) for a in reversed(kept))
        row: list[str | Text] = [Text(f.source_id), str(f.attempts)]
        if all_ or wide:
            row.append(Text("failed", style="bold red") if f.failed else "no")
        row.append(age(last.at) if last else "-")
        if wide:
            row.append(clock(last.at, "milliseconds") if last else "-")
        row += [Text(last.writer_id if last else "-"), Text(reasons or "-")]
        table.add_row(*row)
    out.print(table)
    if all_:
        one, many = "source with failed attempts", "sources with failed attempts"
    else:
        one, many = "failed source", "failed sources"
    them = "it" if len(found) == 1 else "them"
    out.print(
        f"{count(len(found), one, many)} in {checkpoint} ({budget}); "
        f"tally retry {checkpoint} [IDS...] runs {them} again"
    )


def retry(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    source_ids: Annotated[
        list[str] | None, typer.Argument(help="Sources to run again; omit for every source with failures.")
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask before clearing every source.")
    ] = False,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Clear failed attempts so the sources run again: the ones named, or every one."""
    with connect(address, token, timeout) as client:
        if not source_ids and not yes:
            current = client.checkpoint(checkpoint)
            if not sys.stdin.isatty():
                raise fail(
                    f"tally retry {checkpoint} without ids clears the failed attempts of every source "
                    f"({current.failed_sources} failed now): add --yes to do so without a terminal"
                )
            question = (
                f"Clear the failed attempts of every source of {checkpoint} "
                f"({current.failed_sources} failed now), so that they run again?"
            )
            if not typer.confirm(question, default=False):
                raise fail("retry cancelled")
        cleared = client.retry_failed(checkpoint, source_ids or None)
    they = "it runs" if cleared == 1 else "they run"
    out.print(f"cleared the failed attempts of {count(cleared, 'source')} of {checkpoint}; {they} again")


# --------------------------------------------------------------------------- reset


def reset(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    force: Annotated[bool, typer.Option("--force", help="Close live writers instead of refusing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Start a checkpoint over; its files move to the server's trash folder, never deleted."""
    with connect(address, token, timeout) as client:
        current = client.checkpoint(checkpoint)
        if not yes:
            closing = (
                f" and close its {count(current.live_writers, 'live writer')}"
                if force and current.live_writers
                else ""
            )
            question = (
                f"Reset {checkpoint}: forget its {count(current.completed_count, 'completed source')}"
                f"{closing}? (they move to the server's trash; nothing is deleted)"
            )
            try:
                confirmed = typer.confirm(question, default=False)
            except typer.Abort:  # end of input before an answer: a pipe, a script
                err.print()  # end the question's line
                raise fail(
                    f"tally reset {checkpoint} asks for confirmation and got no answer: add --yes to "
                    "reset without a terminal"
                ) from None
            if not confirmed:
                raise fail("reset cancelled")
        try:
            result = client.reset(checkpoint, force=force)
        except tally.FailedPrecondition as exc:
            hint = "" if force else " (tally reset --force does that)"
            raise fail(exc.message + hint) from None
    if not result.moved_to:
        moved = "no files to move"
    elif result.moved_to.startswith("table "):  # a PostgreSQL store: rows, one set per writer's origin
        writers = count(result.files_moved, "writer")
        moved = f"moved the completions of {writers} to {result.moved_to} in the store"
    else:
        moved = (
            f"moved {count(result.files_moved, 'file')} to {result.moved_to} in the server's data directory"
        )
    out.print(f"reset {checkpoint}: {moved}; closed {count(result.writers_closed, 'live writer')}")
